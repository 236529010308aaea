"""Router benchmarks on real Postgres: decision latency at scale, affinity and balance under a skewed replay."""

import random
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

from django.db import connection, transaction
from django.utils import timezone

from router import services
from router.models import Node, SessionAssignment
from router.policies import NodeLoad


def register_nodes(count: int) -> list[str]:
    names = [f"bench-{i}" for i in range(count)]
    now = timezone.now()
    Node.objects.bulk_create(
        [Node(name=n, queue=services.queue_for_node(n), capacity=16, last_heartbeat=now) for n in names]
    )
    return names


@contextmanager
def heartbeating(names: list[str], every: float = 1.0) -> Iterator[None]:
    """Keep the benchmark's nodes heartbeating from a thread, as live nodes would."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(every):
            for name in names:  # one row per statement, as each live node does for itself
                Node.objects.filter(name=name).update(last_heartbeat=timezone.now())
        connection.close()

    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def preassign(sessions: int, names: list[str]) -> None:
    """Place `sessions` sessions the way the sticky policy would, in bulk."""
    policy = services.policy_get("sticky")
    loads = Counter({name: 0 for name in names})
    rows = []
    for i in range(sessions):
        key = f"pre:{i}"
        choice = policy.choose(session_key=key, current=None, nodes=[NodeLoad(n, loads[n]) for n in names])
        loads[choice.node] += 1
        rows.append((key, choice.node))
    nodes = {n.name: n for n in Node.objects.filter(name__in=names)}
    SessionAssignment.objects.bulk_create(
        [SessionAssignment(session_key=k, node=nodes[n], reason=choice.reason) for k, n in rows], batch_size=2000
    )
    for name, load in loads.items():
        Node.objects.filter(name=name).update(sessions=load)


def assign_latency(sessions: int, decisions: int, seed: int) -> dict[str, float]:
    """Decision latency: follow-up turns of existing sessions, and some new ones."""
    rng = random.Random(seed)  # noqa: S311
    timings = []
    for i in range(decisions):
        key = f"pre:{rng.randrange(sessions)}" if i % 10 else f"new:{i}"
        start = time.perf_counter()
        services.session_node(session_key=key)
        timings.append((time.perf_counter() - start) * 1000)
    timings.sort()
    return {
        "p50_assign_ms": statistics.median(timings),
        "p99_assign_ms": timings[int(0.99 * (len(timings) - 1))],
    }


def skewed_replay(policy: str, sessions: int, turns: int, seed: int) -> dict[str, float]:
    """Turns drawn Zipf-like over sessions (a few very active, many quiet), all nodes healthy."""
    rng = random.Random(seed)  # noqa: S311
    weights = [1 / (rank + 1) ** 1.1 for rank in range(sessions)]
    keys = [f"{policy}:{k}" for k in rng.choices(range(sessions), weights=weights, k=turns)]
    previous: dict[str, str] = {}
    same = follow_ups = 0
    served: Counter[str] = Counter()
    for key in keys:
        node = services.session_node(session_key=key, policy=policy).name
        served[node] += 1
        if key in previous:
            follow_ups += 1
            same += previous[key] == node
        previous[key] = node
    placed = Counter(previous.values())
    mean = sum(placed.values()) / len(placed)
    return {
        "affinity": same / follow_ups,
        "max_mean_load": max(placed.values()) / mean,
        "max_mean_turns": max(served.values()) / (sum(served.values()) / len(served)),
    }


def clear_assignments() -> None:
    with transaction.atomic():
        SessionAssignment.objects.all().delete()
        Node.objects.update(sessions=0)
