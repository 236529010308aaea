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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from chatapp.experiments.report import percentile
from router.policies import ClusterView, NodeLoad, RoutingPolicy, smoothed


@dataclass(frozen=True)
class NodeProfile:
    prefill_tokens_per_s: float
    step_ms_one: float  # a decode step with one sequence
    step_ms_per_extra: float  # added per further sequence in the step
    slots: int  # generations decoded together (MAX_CONCURRENT)
    kv_tokens: float  # tokens of prefix cache a node keeps (resident and spilled); float('inf'): unbounded
    # From sending a turn to its node's engine starting on it: routing, the database, the Celery queue.
    dispatch_ms: float = 0.0
    heartbeat_s: float = 2.0  # how often a node reports its work to the router (ROUTER_HEARTBEAT_SECONDS)

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


@dataclass(slots=True)
class _Node:
    name: str
    cache: OrderedDict = field(default_factory=OrderedDict)  # session key -> tokens held, LRU first
    cached_total: int = 0
    # request id -> finish time, less `stalled`: a prefill holds up every decoder at once by adding to it
    decoding: dict = field(default_factory=dict)
    stalled: float = 0.0
    waiting: deque = field(default_factory=deque)
    prefill_free_s: float = 0.0
    turns: int = 0
    reported_s: float = float("-inf")  # its last heartbeat


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
    moves: int = 0
    warm_moves: int = 0  # moves that left a cache the session could have used

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
            "moves_per_turn": self.moves / self.requests if self.requests else None,
            "warm_moves_per_turn": self.warm_moves / self.requests if self.requests else None,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


_OPEN, _ARRIVE, _REACH, _FINISH = 0, 1, 2, 3


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
        self.view = ClusterView(NodeLoad(name, 0) for name in names)  # what the router sees of the nodes
        self.assigned: dict[str, int] = {}
        self.events: list = []
        self.seq = 0
        self.requests: dict[int, tuple] = {}
        self.result = SimResult()
        self.concurrency = concurrency
        self.pending = deque(range(len(sessions)))

    def _open_next(self, opening: Iterator[tuple[float, int]]) -> None:
        opens = next(opening, None)
        if opens is not None:
            self._push(opens[0], _OPEN, opens[1])

    def _push(self, time_s: float, kind: int, payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (time_s, self.seq, kind, payload))

    def run(self) -> SimResult:
        opening: Iterator[tuple[float, int]] = iter(())
        if self.concurrency:
            for _ in range(min(self.concurrency, len(self.sessions))):
                self._push(0.0, _ARRIVE, (self.pending.popleft(), 0))
        else:  # sessions open in time order, each pushed when the one before it opens: the heap stays small
            opening = iter(sorted((x.start_s + x.turns[0].think_s, s) for s, x in enumerate(self.sessions)))
            self._open_next(opening)
            self.pending.clear()
        now = 0.0
        while self.events:
            now, _, kind, payload = heapq.heappop(self.events)
            if kind == _OPEN:
                self._open_next(opening)
                self._arrive(now, payload, 0)
            elif kind == _ARRIVE:
                self._arrive(now, *payload)
            elif kind == _REACH:
                self._reach(now, payload)
            else:
                self._finish(now, payload)
        self.result.makespan_s = now
        self.result.node_turns = [n.turns for n in self.nodes]
        self.result.node_sessions = [self.view.get(n.name).sessions for n in self.nodes]
        return self.result

    def _route(self, key: str, *, breaks: bool) -> int:
        """The router's decision. The session is cold on its node if its prompt breaks its prefix (the
        application knows) or its node's cache no longer holds it (the node reports what it drops)."""
        current = self.assigned.get(key)
        held = current is not None and key in self.nodes[current].cache
        current_load = None if current is None else self.view.get(self.nodes[current].name)
        choice = self.policy.choose(session_key=key, current=current_load, view=self.view, cold=breaks or not held)
        chosen = self.index[choice.node]
        if chosen != current:
            if current is not None:
                self.view.add_sessions(self.nodes[current].name, -1)
                self.result.moves += 1
                self.result.warm_moves += held and not breaks
            self.view.add_sessions(choice.node, 1)
            self.assigned[key] = chosen
        return chosen

    def _report(self, now: float, node: _Node) -> None:
        """The node's heartbeat (one is due): its requests running and waiting, and its KV use."""
        node.reported_s = now
        seen = self.view.get(node.name)
        kv = node.cached_total / self.profile.kv_tokens if self.profile.kv_tokens != float("inf") else 0.0
        work = smoothed(seen.work, len(node.decoding) + len(node.waiting))
        self.view.update(NodeLoad(node.name, seen.sessions, work, min(1.0, kv)))

    def _arrive(self, now: float, s: int, t: int) -> None:
        """The turn is sent: routed now, it reaches its node `dispatch_ms` later."""
        turns = self.sessions[s].turns
        breaks = t > 0 and turns[t].reusable_tokens < turns[t - 1].prompt_tokens
        node_i = self._route(self.sessions[s].key, breaks=breaks)
        self.result.requests += 1
        request_id = self.seq
        self.requests[request_id] = (s, t, now, node_i)
        self._push(now + self.profile.dispatch_ms / 1000, _REACH, request_id)

    def _reach(self, now: float, request_id: int) -> None:
        node = self.nodes[self.requests[request_id][3]]
        if now - node.reported_s >= self.profile.heartbeat_s:
            self._report(now, node)
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
        node.stalled += prefill_s  # prefill steps hold up everyone decoding on this node
        step = self.profile.step_s(len(node.decoding) + 1)
        first_token = node.prefill_free_s + step
        finish = first_token + (turn.reply_tokens - 1) * step
        node.decoding[request_id] = finish - node.stalled
        self._push(finish, _FINISH, request_id)
        r = self.result
        r.prompt_tokens += turn.prompt_tokens
        r.reusable_tokens += turn.reusable_tokens
        r.hit_tokens += hit
        r.ttft_s.append(first_token - arrived)

    def _finish(self, now: float, request_id: int) -> None:
        s, t, arrived, node_i = self.requests[request_id]
        node = self.nodes[node_i]
        due = node.decoding[request_id] + node.stalled
        if due > now:  # held up by a prefill since this event was scheduled
            self._push(due, _FINISH, request_id)
            return
        del node.decoding[request_id], self.requests[request_id]
        if now - node.reported_s >= self.profile.heartbeat_s:
            self._report(now, node)
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
    profiles: Sequence[Sequence[SimTurn]], *, count: int, rate_per_s: float, seed: int, skew: float = 0.0
) -> list[SimSession]:
    """`count` sessions drawn (with replacement) from measured turn profiles, opening as a Poisson
    process of `rate_per_s`; the same seed gives the same sessions whatever the rate (common random numbers).

    With `skew` (a Pareto shape, e.g. 1.2), activity is skewed as in real chat traffic: a session runs its
    profile `r` times over (r Pareto-distributed, at most 50; each repetition starts with a broken prefix,
    as after a chunked drop) and thinks `r` times faster, so a few sessions send most of the turns."""
    rng = random.Random(seed)  # noqa: S311 (simulation, not security)
    sessions, gap = [], 0.0
    for k in range(count):
        turns = tuple(profiles[rng.randrange(len(profiles))])
        if skew:
            repeats = min(50, int(rng.paretovariate(skew)))
            turns = tuple(replace(t, think_s=t.think_s / repeats) for t in turns) * repeats
        sessions.append(SimSession(f"session:{k}", turns, gap / rate_per_s))
        gap += rng.expovariate(1.0)
    return sessions
