"""A discrete-event simulation of a cluster of inference nodes, for sizes no machine here can run.

Sessions arrive, think, and send turns; the router's own policy classes place them; each node keeps an
LRU prefix cache of `kv_tokens` tokens (a session it holds nothing of reuses the opening every session shares,
once it holds any other) and serves up to `slots` generations at once. A node's time model
follows the engine (inference.batch_engine): prefill is compute-bound at `prefill_tokens_per_s` and stalls
the node's decoding while it runs (chunked prefill shares the step with decode), and a decode step for `b`
sequences takes `step_ms(b)`, linear in `b` (the LM head is computed once per sequence). The figures come
from measuring the real engine (`calibrate`); `compare` checks the model against a real replay.
"""

import gc
import heapq
import itertools
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

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


class SimTurn(NamedTuple):  # tuples: a large run holds millions
    prompt_tokens: int
    reusable_tokens: int  # the most of this prompt a perfect cache would hold (it extends the previous one)
    reply_tokens: int
    think_s: float = 0.0  # before this turn is sent, after the previous reply
    # Its first tokens that every session's prompt starts with (BOS, a system prompt, the user's marker): a
    # node holding another session starts a session it holds nothing of from them (prefix sharing).
    shared_tokens: int = 0


class SimSession(NamedTuple):
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


class _Request:
    """A session's turn in flight: the event heap's payload, and the key of its node's decoding table. A
    session has one turn in flight at a time, so one object carries all its turns in turn."""

    __slots__ = ("arrived", "node", "session", "t", "turn")
    node: _Node  # set when it is routed

    def __init__(self, session: SimSession) -> None:
        self.session, self.t = session, 0
        self.turn: SimTurn = session.turns[0]
        self.arrived = 0.0


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
        self.ttft_s.sort()  # once: each percentile below then copies a sorted list, in linear time
        self.latency_s.sort()
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


class Simulation:
    """One run: `sessions` on `nodes` nodes of `profile`, routed by `policy`.

    With `concurrency`, at most that many sessions are open at once (a closed loop, like a replay's
    worker threads); otherwise each session opens at its `start_s`. With `held_opening`, each node starts
    holding that many tokens of the opening sessions share (earlier sessions' state), as a node that served
    turns before does.
    """

    def __init__(
        self,
        *,
        profile: NodeProfile,
        nodes: int | Sequence[str],
        policy: RoutingPolicy,
        sessions: Sequence[SimSession],
        concurrency: int | None = None,
        held_opening: int = 0,
    ) -> None:
        names = [f"node-{i}" for i in range(nodes)] if isinstance(nodes, int) else list(nodes)
        self.profile, self.policy, self.sessions = profile, policy, sessions
        self.nodes = [_Node(name) for name in names]
        self.by_name = {node.name: node for node in self.nodes}
        self.view = ClusterView(NodeLoad(name, 0) for name in names)  # what the router sees of the nodes
        self.assigned: dict[str, _Node] = {}
        self.events: list = []
        self._seq = itertools.count()  # ties in time break in push order
        self.dispatch_s = profile.dispatch_ms / 1000
        self.heartbeat_s, self.slots = profile.heartbeat_s, profile.slots
        self.kv_tokens, self.prefill_s_per_token = profile.kv_tokens, 1 / profile.prefill_tokens_per_s
        self.step_s_one, self.step_s_per_extra = profile.step_s(1), profile.step_ms_per_extra / 1000
        self.result = SimResult()
        self.concurrency = concurrency
        self.pending = deque(range(len(sessions)))
        self.opening: Iterator[tuple[float, int]] = iter(())
        for node in self.nodes if held_opening else ():
            self._cache(node, "(earlier sessions)", held_opening)

    def _push(self, time_s: float, handler: Callable[[float, Any], None], payload: Any) -> None:
        """Call `handler(time_s, payload)` at `time_s` of simulated time (ties in push order)."""
        heapq.heappush(self.events, (time_s, next(self._seq), handler, payload))

    def run(self) -> SimResult:
        with _collector_paused():
            return self._run()

    def _run(self) -> SimResult:
        if self.concurrency:
            for _ in range(min(self.concurrency, len(self.sessions))):
                self._push(0.0, self._arrive, _Request(self.sessions[self.pending.popleft()]))
        else:  # sessions open in time order, each pushed when the one before it opens: the heap stays small
            self.opening = iter(sorted((x.start_s + x.turns[0].think_s, s) for s, x in enumerate(self.sessions)))
            self._open_next()
            self.pending.clear()
        now, events, pop = 0.0, self.events, heapq.heappop
        while events:
            now, _, handler, payload = pop(events)
            handler(now, payload)
        self.result.completed = len(self.result.latency_s)
        self.result.makespan_s = now
        self.result.node_turns = [n.turns for n in self.nodes]
        self.result.node_sessions = [self.view.get(n.name).sessions for n in self.nodes]
        return self.result

    def _open_next(self) -> None:
        opens = next(self.opening, None)
        if opens is not None:
            self._push(opens[0], self._open, opens[1])

    def _open(self, now: float, s: int) -> None:
        """Session `s` opens, and the next one is due."""
        self._open_next()
        self._arrive(now, _Request(self.sessions[s]))

    def _route(self, key: str, *, breaks: bool) -> _Node:
        """The router's decision. The session is cold on its node if its prompt breaks its prefix (the
        application knows) or its node's cache no longer holds it (the node reports what it drops)."""
        current = self.assigned.get(key)
        view = self.view
        if current is None:
            held, current_load = False, None
        else:
            held, current_load = key in current.cache, view.get(current.name)
        chosen = self.by_name[
            self.policy.choose(session_key=key, current=current_load, view=view, cold=breaks or not held).node
        ]
        if chosen is not current:
            view.add_sessions(chosen.name, 1)
            if current is not None:
                view.add_sessions(current.name, -1)
                self.result.moves += 1
                self.result.warm_moves += held and not breaks
            self.assigned[key] = chosen
        return chosen

    def _report(self, now: float, node: _Node) -> None:
        """The node's heartbeat (one is due): its requests running and waiting, and its KV use."""
        node.reported_s = now
        seen = self.view.get(node.name)
        kv = min(1.0, node.cached_total / self.kv_tokens)
        work = smoothed(seen.work, len(node.decoding) + len(node.waiting))
        if work != seen.work or kv != seen.kv:
            self.view.update(NodeLoad(node.name, seen.sessions, work, kv))

    def _arrive(self, now: float, request: "_Request") -> None:
        """The request's turn is sent: routed now, it reaches its node `dispatch_ms` later."""
        turns, t = request.session.turns, request.t
        turn = request.turn = turns[t]
        breaks = t > 0 and turn.reusable_tokens < turns[t - 1].prompt_tokens
        request.node = self._route(request.session.key, breaks=breaks)
        request.arrived = now
        self.result.requests += 1
        if self.dispatch_s:
            self._push(now + self.dispatch_s, self._reach, request)
        else:  # it is there at once
            self._reach(now, request)

    def _reach(self, now: float, request: "_Request") -> None:
        node = request.node
        if now - node.reported_s >= self.heartbeat_s:
            self._report(now, node)
        if len(node.decoding) < self.slots:
            self._start(now, request)
        else:
            node.waiting.append(request)

    def _start(self, now: float, request: "_Request") -> None:
        node, turn, key = request.node, request.turn, request.session.key
        hit = min(turn.reusable_tokens, node.cache.get(key, 0))
        if hit < turn.shared_tokens and len(node.cache) > (key in node.cache):  # another session holds the opening
            hit = turn.shared_tokens
        hit = min(hit, turn.prompt_tokens - 1)
        prefill_s = (turn.prompt_tokens - hit) * self.prefill_s_per_token
        node.prefill_free_s = (now if now > node.prefill_free_s else node.prefill_free_s) + prefill_s
        node.stalled += prefill_s  # prefill steps hold up everyone decoding on this node
        step = self.step_s_one + self.step_s_per_extra * len(node.decoding)
        first_token = node.prefill_free_s + step
        finish = first_token + (turn.reply_tokens - 1) * step
        node.decoding[request] = finish - node.stalled
        self._push(finish, self._finish, request)
        r = self.result
        r.prompt_tokens += turn.prompt_tokens
        r.reusable_tokens += turn.reusable_tokens
        r.hit_tokens += hit
        r.ttft_s.append(first_token - request.arrived)

    def _finish(self, now: float, request: "_Request") -> None:
        node = request.node
        due = node.decoding[request] + node.stalled
        if due > now:  # held up by a prefill since this event was scheduled
            self._push(due, self._finish, request)
            return
        del node.decoding[request]
        if now - node.reported_s >= self.heartbeat_s:
            self._report(now, node)
        session, turn = request.session, request.turn
        self._cache(node, session.key, turn.prompt_tokens + turn.reply_tokens)
        node.turns += 1
        self.result.latency_s.append(now - request.arrived)
        if node.waiting:
            self._start(now, node.waiting.popleft())
        request.t += 1
        if request.t < len(session.turns):  # the same request object carries the session's next turn
            self._push(now + session.turns[request.t].think_s, self._arrive, request)
            return
        del self.assigned[session.key]  # it sends no more turns (its node still counts it, as the router does)
        if self.pending:
            self._push(now, self._arrive, _Request(self.sessions[self.pending.popleft()]))

    def _cache(self, node: _Node, key: str, tokens: int) -> None:
        cache = node.cache
        if key in cache:
            node.cached_total += tokens - cache[key]
            cache.move_to_end(key)
        else:
            node.cached_total += tokens
        cache[key] = tokens
        while node.cached_total > self.kv_tokens and cache:
            node.cached_total -= cache.popitem(last=False)[1]


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Without the cyclic garbage collector: a run allocates millions of small objects and makes no cycles,
    so the collector's passes over them (a tenth of a large run's time) would find nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
    shapes = [tuple(p) for p in profiles]  # sessions of one shape share its tuple
    sessions, gap = [], 0.0
    for k in range(count):
        turns = shapes[rng.randrange(len(shapes))]
        if skew:
            repeats = min(50, int(rng.paretovariate(skew)))
            turns = tuple(t._replace(think_s=t.think_s / repeats) for t in turns) * repeats
        sessions.append(SimSession(f"session:{k}", turns, gap / rate_per_s))
        gap += rng.expovariate(1.0)
    return sessions
