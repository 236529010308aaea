"""A discrete-event simulation of a cluster of inference nodes, for sizes no machine here can run.

Sessions arrive, think, and send turns; the router's own policy classes place them; each node keeps an
LRU prefix cache of `kv_tokens` tokens and serves up to `slots` generations at once. A node's time model
follows the engine (inference.batch_engine): prefill is compute-bound at `prefill_tokens_per_s` and stalls
the node's decoding while it runs (chunked prefill shares the step with decode), and a decode step for `b`
sequences takes `step_ms(b)`, linear in `b` (the LM head is computed once per sequence). The figures come
from measuring the real engine (`calibrate`); `compare` checks the model against a real replay.
"""

import heapq
import random
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from chatapp.experiments.report import percentile
from router.policies import NodeLoad, RoutingPolicy


@dataclass(frozen=True)
class NodeProfile:
    prefill_tokens_per_s: float
    step_ms_one: float  # a decode step with one sequence
    step_ms_per_extra: float  # added per further sequence in the step
    slots: int  # generations decoded together (MAX_CONCURRENT)
    kv_tokens: float  # tokens of prefix cache a node keeps (resident and spilled); float('inf'): unbounded
    # From sending a turn to its node's engine starting on it: routing, the database, the Celery queue.
    dispatch_ms: float = 0.0

    def step_s(self, sequences: int) -> float:
        return (self.step_ms_one + self.step_ms_per_extra * max(0, sequences - 1)) / 1000


@dataclass(frozen=True)
class SimTurn:
    prompt_tokens: int
    reusable_tokens: int  # the most of this prompt a perfect cache would hold (it extends the previous one)
    reply_tokens: int
    think_s: float = 0.0  # before this turn is sent, after the previous reply


@dataclass(frozen=True)
class SimSession:
    key: str
    turns: tuple[SimTurn, ...]
    start_s: float = 0.0


@dataclass
class _Node:
    name: str
    cache: OrderedDict = field(default_factory=OrderedDict)  # session key -> tokens held, LRU first
    cached_total: int = 0
    decoding: dict = field(default_factory=dict)  # request id -> finish time
    waiting: deque = field(default_factory=deque)
    prefill_free_s: float = 0.0
    turns: int = 0


@dataclass
class SimResult:
    requests: int = 0
    completed: int = 0
    prompt_tokens: int = 0
    reusable_tokens: int = 0
    hit_tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    latency_s: list[float] = field(default_factory=list)
    makespan_s: float = 0.0
    node_turns: list[int] = field(default_factory=list)
    node_sessions: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        mean_turns = sum(self.node_turns) / len(self.node_turns)
        mean_sessions = sum(self.node_sessions) / len(self.node_sessions)
        return {
            "nodes": len(self.node_turns),
            "requests": self.requests,
            "completed": self.completed,
            "cache_hit_ratio": self.hit_tokens / self.prompt_tokens if self.prompt_tokens else None,
            "reuse_captured": self.hit_tokens / self.reusable_tokens if self.reusable_tokens else None,
            "ttft_ms_p50": _ms(percentile(self.ttft_s, 50)),
            "ttft_ms_p99": _ms(percentile(self.ttft_s, 99)),
            "latency_ms_p50": _ms(percentile(self.latency_s, 50)),
            "turns_per_s": self.completed / self.makespan_s if self.makespan_s else None,
            "makespan_s": self.makespan_s,
            "max_mean_turns": max(self.node_turns) / mean_turns if mean_turns else None,
            "max_mean_sessions": max(self.node_sessions) / mean_sessions if mean_sessions else None,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


_ARRIVE, _REACH, _FINISH = 0, 1, 2


class Simulation:
    """One run: `sessions` on `nodes` nodes of `profile`, routed by `policy`.

    With `concurrency`, at most that many sessions are open at once (a closed loop, like a replay's
    worker threads); otherwise each session opens at its `start_s`.
    """

    def __init__(
        self,
        *,
        profile: NodeProfile,
        nodes: int | Sequence[str],
        policy: RoutingPolicy,
        sessions: Sequence[SimSession],
        concurrency: int | None = None,
    ) -> None:
        names = [f"node-{i}" for i in range(nodes)] if isinstance(nodes, int) else list(nodes)
        self.profile, self.policy, self.sessions = profile, policy, sessions
        self.nodes = [_Node(name) for name in names]
        self.index = {name: i for i, name in enumerate(names)}
        self.loads = [NodeLoad(name, 0) for name in names]  # sessions assigned, as the router counts them
        self.total_load = 0
        self.assigned: dict[str, int] = {}
        self.events: list = []
        self.seq = 0
        self.requests: dict[int, tuple] = {}
        self.result = SimResult()
        self.concurrency = concurrency
        self.pending = deque(range(len(sessions)))

    def _push(self, time_s: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time_s, self.seq, kind, payload))

    def run(self) -> SimResult:
        if self.concurrency:
            for _ in range(min(self.concurrency, len(self.sessions))):
                self._push(0.0, _ARRIVE, (self.pending.popleft(), 0))
        else:
            for s, session in enumerate(self.sessions):
                self._push(session.start_s + session.turns[0].think_s, _ARRIVE, (s, 0))
            self.pending.clear()
        now = 0.0
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == _ARRIVE:
                self._arrive(now, *payload)
            elif kind == _REACH:
                self._reach(now, *payload)
            else:
                self._finish(now, *payload)
        self.result.makespan_s = now
        self.result.node_turns = [n.turns for n in self.nodes]
        self.result.node_sessions = [load.load for load in self.loads]
        return self.result

    def _route(self, key: str) -> int:
        current = self.assigned.get(key)
        if current is not None and self.policy.keeps(
            load=self.loads[current].load, mean=self.total_load / len(self.nodes)
        ):
            return current
        choice = self.index[
            self.policy.choose(
                session_key=key, current=None if current is None else self.nodes[current].name, nodes=self.loads
            ).node
        ]
        if choice != current:
            if current is not None:
                self._add_load(current, -1)
            self._add_load(choice, 1)
            self.assigned[key] = choice
        return choice

    def _add_load(self, i: int, delta: int) -> None:
        self.loads[i] = NodeLoad(self.loads[i].name, self.loads[i].load + delta)
        self.total_load += delta

    def _arrive(self, now: float, s: int, t: int) -> None:
        """The turn is sent: routed now, it reaches its node `dispatch_ms` later."""
        node_i = self._route(self.sessions[s].key)
        self.result.requests += 1
        request_id = self.seq
        self.requests[request_id] = (s, t, now, node_i)
        self._push(now + self.profile.dispatch_ms / 1000, _REACH, (request_id,))

    def _reach(self, now: float, request_id: int) -> None:
        node = self.nodes[self.requests[request_id][3]]
        if len(node.decoding) < self.profile.slots:
            self._start(now, request_id)
        else:
            node.waiting.append(request_id)

    def _start(self, now: float, request_id: int) -> None:
        s, t, arrived, node_i = self.requests[request_id]
        node, turn, key = self.nodes[node_i], self.sessions[s].turns[t], self.sessions[s].key
        hit = min(turn.reusable_tokens, node.cache.get(key, 0), turn.prompt_tokens - 1)
        prefill_s = (turn.prompt_tokens - hit) / self.profile.prefill_tokens_per_s
        node.prefill_free_s = max(now, node.prefill_free_s) + prefill_s
        for other in node.decoding:  # prefill steps hold up everyone decoding on this node
            node.decoding[other] += prefill_s
        step = self.profile.step_s(len(node.decoding) + 1)
        first_token = node.prefill_free_s + step
        node.decoding[request_id] = first_token + (turn.reply_tokens - 1) * step
        self._push(node.decoding[request_id], _FINISH, (request_id,))
        r = self.result
        r.prompt_tokens += turn.prompt_tokens
        r.reusable_tokens += turn.reusable_tokens
        r.hit_tokens += hit
        r.ttft_s.append(first_token - arrived)

    def _finish(self, now: float, request_id: int) -> None:
        s, t, arrived, node_i = self.requests[request_id]
        node = self.nodes[node_i]
        due = node.decoding[request_id]
        if due > now:  # held up by a prefill since this event was scheduled
            self._push(due, _FINISH, (request_id,))
            return
        del node.decoding[request_id], self.requests[request_id]
        session, turn = self.sessions[s], self.sessions[s].turns[t]
        self._cache(node, session.key, turn.prompt_tokens + turn.reply_tokens)
        node.turns += 1
        self.result.completed += 1
        self.result.latency_s.append(now - arrived)
        if node.waiting:
            self._start(now, node.waiting.popleft())
        if t + 1 < len(session.turns):
            self._push(now + session.turns[t + 1].think_s, _ARRIVE, (s, t + 1))
        elif self.pending:
            self._push(now, _ARRIVE, (self.pending.popleft(), 0))

    def _cache(self, node: _Node, key: str, tokens: int) -> None:
        node.cached_total += tokens - node.cache.pop(key, 0)
        node.cache[key] = tokens
        while node.cached_total > self.profile.kv_tokens and node.cache:
            _, dropped = node.cache.popitem(last=False)
            node.cached_total -= dropped


def think_time_s(rng: random.Random, reply_tokens: int, next_message: str) -> float:
    """Reading the reply (about 4 tokens a second) and typing the next message (about 5 characters a
    second), with exponential jitter: the dataset has no timestamps, so this is a model of them."""
    return (reply_tokens / 4 + len(next_message) / 5) * rng.expovariate(1.0)


def sessions_from_profiles(
    profiles: Sequence[Sequence[SimTurn]], *, count: int, rate_per_s: float, seed: int
) -> list[SimSession]:
    """`count` sessions drawn (with replacement) from measured turn profiles, opening as a Poisson
    process of `rate_per_s`; the same seed gives the same sessions whatever the rate (common random numbers)."""
    rng = random.Random(seed)  # noqa: S311 (simulation, not security)
    sessions, gap = [], 0.0
    for k in range(count):
        sessions.append(SimSession(f"session:{k}", tuple(profiles[rng.randrange(len(profiles))]), gap / rate_per_s))
        gap += rng.expovariate(1.0)
    return sessions
