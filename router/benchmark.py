"""Router benchmarks on real Postgres: decision latency at scale, affinity, balance and warm moves under a
skewed replay."""

import multiprocessing
import random
import statistics
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.synchronize import Event

from django.conf import settings
from django.db import connection, transaction
from django.utils import timezone

from router import services
from router.models import AssignmentMove, Node, SessionAssignment
from router.policies import ClusterView, NodeLoad

PREFIX = "bench-"


def register_nodes(count: int) -> list[str]:
    names = [f"{PREFIX}{i}" for i in range(count)]
    now = timezone.now()
    Node.objects.bulk_create(
        [Node(name=n, queue=services.queue_for_node(n), capacity=16, last_heartbeat=now) for n in names]
    )
    services.views_forget()
    return names


def remove_nodes() -> None:
    clear_assignments()
    Node.objects.filter(name__startswith=PREFIX).delete()
    services.views_forget()


@contextmanager
def heartbeating(rows: int = 20) -> Iterator[None]:
    """Keep the benchmark's nodes heartbeating every ROUTER_HEARTBEAT_SECONDS from another process, as live
    nodes do (a thread here would take the interpreter lock from the decisions timed), `rows` nodes a
    statement. (Live nodes send one row each; one statement for 1,000 rows would hold every node's row lock
    at once, and stall placements.)"""
    context = multiprocessing.get_context("fork")
    stop = context.Event()
    # The child opens its own connections: a pool forked with the process would share these sockets.
    connection.close()
    connection.close_pool()  # type: ignore[attr-defined]
    beater = context.Process(target=_beat, args=(stop, settings.ROUTER_HEARTBEAT_SECONDS, rows), daemon=True)
    beater.start()
    try:
        yield
    finally:
        stop.set()
        beater.join()


def _beat(stop: Event, every: float, rows: int) -> None:
    """What a live node's heartbeat writes that the router reads: its time, and its sessions counted."""
    while not stop.wait(every):
        ids = list(Node.objects.filter(name__startswith=PREFIX).values_list("id", flat=True))
        for start in range(0, len(ids), rows):
            Node.objects.filter(id__in=ids[start : start + rows]).update(
                last_heartbeat=timezone.now(), sessions=services.sessions_counted()
            )
    connection.close()


def preassign(sessions: int, names: list[str]) -> None:
    """Place `sessions` sessions the way the default policy would, in bulk."""
    policy = services.policy_get()
    view = ClusterView(NodeLoad(n, 0) for n in names)
    rows = []
    for i in range(sessions):
        key = f"pre:{i}"
        choice = policy.choose(session_key=key, current=None, view=view)
        view.add_sessions(choice.node, 1)
        rows.append((key, choice.node, choice.reason))
    nodes = {n.name: n for n in Node.objects.filter(name__in=names)}
    SessionAssignment.objects.bulk_create(
        [SessionAssignment(session_key=k, node=nodes[n], reason=r) for k, n, r in rows], batch_size=2000
    )
    for name in names:
        Node.objects.filter(name=name).update(sessions=view.get(name).sessions)


def assign_latency(sessions: int, decisions: int, seed: int, names: list[str]) -> dict[str, float]:
    """Latency of `session_node` as `turn_start` calls it, inside the turn's transaction: follow-up turns of
    existing sessions, and first turns of new ones (one in ten, with the `new` hint the web gives them; new
    to every run with another seed);
    the commit after it apart (the turn's own, which makes its message durable with its placement); the
    policy's decision alone, placing a new session in a view of every node (no database); and a follow-up
    that reads the nodes first, as one decision a ROUTER_VIEW_SECONDS does in each process (median)."""
    rng = random.Random(seed)  # noqa: S311
    policy = services.policy_get()
    view = ClusterView(NodeLoad(n, sessions // len(names)) for n in names)
    decisions_alone = []
    for i in range(decisions):
        start = time.perf_counter()
        choice = policy.choose(session_key=f"alone:{i}", current=None, view=view)
        decisions_alone.append((time.perf_counter() - start) * 1000)
        view.add_sessions(choice.node, 1)
    follow_ups: list[float] = []
    placements: list[float] = []
    commits: list[float] = []
    for i in range(decisions):
        new = i % 10 == 0
        key = f"new:{seed}:{i}" if new else f"pre:{rng.randrange(sessions)}"
        with transaction.atomic(), connection.cursor() as cursor:
            cursor.execute("SELECT 1")  # begun, as turn_start's transaction is (it locks the conversation first)
            start = time.perf_counter()
            services.session_node(session_key=key, new=new)
            decided = time.perf_counter()
        commits.append((time.perf_counter() - decided) * 1000)
        (placements if new else follow_ups).append((decided - start) * 1000)
    view_reads = []
    for _ in range(20):
        start = time.perf_counter()
        services.views_forget()
        services.session_node(session_key=f"pre:{rng.randrange(sessions)}")
        view_reads.append((time.perf_counter() - start) * 1000)
    timings = sorted(follow_ups + placements)
    return {
        "p50_assign_ms": statistics.median(timings),
        "p99_assign_ms": _percentile(timings, 99),
        "p99_follow_up_ms": _percentile(sorted(follow_ups), 99),
        "p99_placement_ms": _percentile(sorted(placements), 99),
        "p99_commit_ms": _percentile(sorted(commits), 99),
        "p99_decision_alone_ms": _percentile(sorted(decisions_alone), 99),
        "view_read_ms": statistics.median(view_reads),
    }


def _percentile(ordered: list[float], p: float) -> float:
    return ordered[int(p / 100 * (len(ordered) - 1))]


@dataclass(frozen=True)
class ReplayShape:
    """The skewed replay's model of time and caches. Turns come one a tick; each keeps its node busy for
    `turn_ticks` ticks (running, then waiting past `slots`); nodes heartbeat every `heartbeat_ticks` with
    that work; a node's memory holds its `held` most recently used sessions and reports those it drops;
    a session's prompt breaks its prefix every `break_every` of its turns (a stable-prefix drop)."""

    turn_ticks: int = 32
    heartbeat_ticks: int = 16
    slots: int = 4
    held: int = 64
    break_every: int = 20


class _FakeNode:
    def __init__(self, name: str) -> None:
        self.name = name
        self.busy_until: deque[int] = deque()
        self.memory: OrderedDict[str, None] = OrderedDict()
        self.dropped: list[str] = []

    def serve(self, key: str, tick: int, shape: ReplayShape) -> None:
        self.busy_until.append(tick + shape.turn_ticks)
        self.memory.pop(key, None)
        self.memory[key] = None
        while len(self.memory) > shape.held:
            self.dropped.append(self.memory.popitem(last=False)[0])

    def heartbeat(self, tick: int, shape: ReplayShape) -> None:
        while self.busy_until and self.busy_until[0] <= tick:
            self.busy_until.popleft()
        busy = len(self.busy_until)
        stats = {
            "running": min(busy, shape.slots),
            "waiting": max(0, busy - shape.slots),
            "sessions": dict.fromkeys(self.memory, "resident"),
            "sessions_complete": True,
            "dropped": self.dropped,
        }
        services.node_heartbeat(name=self.name, capacity=16, stats=stats, incarnation="", served=_SERVED)
        self.dropped = []


_SERVED = services.ServedModel(model="", model_path="", chat_template="", n_ctx=0, max_reply_tokens=0)


def skewed_replay(policy: str, names: list[str], sessions: int, turns: int, seed: int, shape: ReplayShape) -> dict:
    """Turns drawn Zipf-like over sessions (a few very active, many quiet), all nodes healthy, through the
    router's services and the nodes' heartbeats."""
    rng = random.Random(seed)  # noqa: S311
    weights = [1 / (rank + 1) ** 1.1 for rank in range(sessions)]
    keys = [f"{policy}:{k}" for k in rng.choices(range(sessions), weights=weights, k=turns)]
    nodes = {name: _FakeNode(name) for name in names}
    previous: dict[str, str] = {}
    own_turns: Counter[str] = Counter()
    same = follow_ups = 0
    served: Counter[str] = Counter()
    for tick, key in enumerate(keys):
        if tick % shape.heartbeat_ticks == 0:
            for node in nodes.values():
                node.heartbeat(tick, shape)
            services.views_forget()  # the router reads the loads as often as they change (in replay time)
        breaks = own_turns[key] > 0 and own_turns[key] % shape.break_every == 0
        own_turns[key] += 1
        name = services.session_node(session_key=key, policy=policy, cold=breaks).name
        nodes[name].serve(key, tick, shape)
        served[name] += 1
        if key in previous:
            follow_ups += 1
            same += previous[key] == name
        previous[key] = name
    placed = Counter(previous.values())
    moves = list(AssignmentMove.objects.filter(session_key__startswith=f"{policy}:"))
    return {
        "affinity": same / follow_ups,
        "max_mean_load": max(placed.values()) / (sum(placed.values()) / len(names)),
        "max_mean_turns": max(served.values()) / (turns / len(names)),
        "moves_per_turn": len(moves) / turns,
        "warm_moves_per_turn": sum(m.warm for m in moves) / turns,
    }


def median_and_range(runs: list[dict]) -> dict:
    """Each figure's median over the runs, and its range (`<name>_range`: [lowest, highest])."""
    summary: dict = {}
    for key in runs[0]:
        values = sorted(run[key] for run in runs)
        summary[key] = statistics.median(values)
        summary[f"{key}_range"] = [values[0], values[-1]]
    return summary


def clear_assignments() -> None:
    with transaction.atomic():
        SessionAssignment.objects.all().delete()
        AssignmentMove.objects.all().delete()
        Node.objects.update(sessions=0, work=0.0, kv_use=0.0, stats={})
    services.views_forget()
