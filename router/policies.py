"""Routing policies: which healthy node serves a session's next turn.

A policy is one small class with one method, `choose`, given the session, its node's load now (if that
node is healthy), whether the session's cache there is cold, and a `ClusterView` of the healthy nodes.
Aliases are configured in `settings.ROUTER_POLICIES`, like `CACHES`.

Every decision costs O(log nodes) or less: the view keeps its totals and its nodes bucketed by session
count up to date as loads change, and bounded-load placement walks the consistent-hash ring from the
session's point, looking at the few nodes it passes instead of every node's load.
"""

import bisect
import hashlib
import itertools
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

# How much of a node's reported work a heartbeat replaces: work = (1 - SMOOTHING) x before + SMOOTHING x now.
SMOOTHING = 0.5


class NodeLoad(NamedTuple):  # a tuple: the simulator makes millions
    name: str
    sessions: int  # sessions assigned to it
    work: float = 0.0  # requests running and waiting on its engine, smoothed over its heartbeats
    kv: float = 0.0  # share of its KV cells in use, 0 to 1


# A NodeLoad through tuple.__new__: half the time of its generated __new__ (the simulator makes millions).
_new_tuple = tuple.__new__


class Choice(NamedTuple):
    node: str
    reason: str


def smoothed(previous: float, now: float) -> float:
    """A node's work after a heartbeat reports `now` requests running and waiting."""
    return (1 - SMOOTHING) * previous + SMOOTHING * now


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest())


class ClusterView:
    """The healthy nodes as a router sees them, with their loads.

    Means are O(1) (running totals). The nodes are bucketed by session count (when the least loaded is
    first asked for), so the least loaded node and a move's one-session changes are O(1); only a count that
    jumps while it is the fewest costs a look at every distinct count. The hash ring is built once per set of
    names.
    """

    def __init__(self, nodes: Iterable[NodeLoad], *, replicas: int = 64) -> None:
        self._nodes = {n.name: n for n in nodes}
        self.replicas = replicas
        self.names = tuple(sorted(self._nodes))
        self.total_sessions = sum(n.sessions for n in self._nodes.values())
        self.total_work = sum(n.work for n in self._nodes.values())
        self.total_kv = sum(n.kv for n in self._nodes.values())
        # sessions -> the nodes holding that many, in the order they came to it; built by the first
        # least_loaded(), then kept
        self._by_sessions: dict[int, dict[str, None]] | None = None
        self._fewest = 0  # the least key of _by_sessions
        self._ring: tuple[list[int], list[str]] | None = None

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def get(self, name: str) -> NodeLoad:
        return self._nodes[name]

    @property
    def mean_sessions(self) -> float:
        return self.total_sessions / len(self._nodes)

    @property
    def mean_work(self) -> float:
        return self.total_work / len(self._nodes)

    @property
    def mean_kv(self) -> float:
        return self.total_kv / len(self._nodes)

    def update(self, node: NodeLoad) -> None:
        """Replace a node's figures (it is in the view)."""
        old = self._nodes[node.name]
        self._nodes[node.name] = node
        self.total_sessions += node.sessions - old.sessions
        self.total_work += node.work - old.work
        self.total_kv += node.kv - old.kv
        if node.sessions != old.sessions:
            self._recount(node.name, old.sessions, node.sessions)

    def add_sessions(self, name: str, delta: int) -> None:
        _, sessions, work, kv = self._nodes[name]
        self._nodes[name] = _new_tuple(NodeLoad, (name, sessions + delta, work, kv))
        self.total_sessions += delta
        self._recount(name, sessions, sessions + delta)

    def _recount(self, name: str, old: int, new: int) -> None:
        """Move a node between the counts' buckets: O(1) when its count steps by one, as a move makes."""
        by_sessions = self._by_sessions
        if by_sessions is None or old == new:
            return
        left = by_sessions[old]
        del left[name]
        if not left:
            del by_sessions[old]
        joined = by_sessions.get(new)
        if joined is None:
            by_sessions[new] = {name: None}
        else:
            joined[name] = None
        if new < self._fewest:
            self._fewest = new
        elif old == self._fewest and not left:  # the last of the fewest left: one count up, or a scan
            self._fewest = new if new == old + 1 else min(by_sessions)

    def least_loaded(self, *, besides: str | None = None) -> NodeLoad:
        """The node with the fewest sessions, other than `besides` if there is another. Of nodes with as many,
        the one that has held that many longest."""
        by_sessions = self._by_sessions
        if by_sessions is None:
            by_sessions = self._by_sessions = {}
            for name in self.names:
                by_sessions.setdefault(self._nodes[name].sessions, {})[name] = None
            self._fewest = min(by_sessions)
        for name in by_sessions[self._fewest]:
            if name != besides:
                return self._nodes[name]
        more = [k for k in by_sessions if k != self._fewest]  # the fewest are `besides` alone: O(distinct counts)
        return self._nodes[next(iter(by_sessions[min(more) if more else self._fewest]))]

    def only(self, names: Iterable[str]) -> "ClusterView":
        """A view of these nodes alone (O(n): for a session that must leave its node, which is rare)."""
        return ClusterView((self._nodes[n] for n in names if n in self._nodes), replicas=self.replicas)

    def ring_walk(self, key: str) -> Iterator[str]:
        """Distinct node names clockwise from the key's point on the hash ring."""
        if self._ring is None:
            self._ring = _ring(self.names, self.replicas)
        hashes, owners = self._ring
        seen: set[str] = set()
        i = bisect.bisect(hashes, _hash(key))
        for k in range(len(owners)):
            name = owners[(i + k) % len(owners)]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == len(self._nodes):
                    return


@lru_cache(maxsize=16)
def _ring(names: tuple[str, ...], replicas: int) -> tuple[list[int], list[str]]:
    points = sorted((_hash(f"{name}#{i}"), name) for name in names for i in range(replicas))
    return [p for p, _ in points], [n for _, n in points]


class RoutingPolicy:
    def choose(self, *, session_key: str, current: NodeLoad | None, view: ClusterView, cold: bool = False) -> Choice:
        """Pick a node of `view` (healthy, non-empty). `current` is the session's node if it is among them,
        with its figures now; `cold`: its cache there is known to be lost or broken, so a move is free."""
        raise NotImplementedError


@dataclass(frozen=True)
class LoadModel:
    """A node's load relative to the cluster: the weighted mean of its sessions, work and KV use, each over
    the cluster's mean (so the cluster's mean load is 1). Work and KV use get a floor (`work_floor`
    requests, `kv_floor` of the cells) added to both sides, so that a nearly idle cluster does not read one
    running request as an overload."""

    sessions: float = 1.0
    work: float = 0.0
    kv: float = 0.0
    work_floor: float = 1.0
    kv_floor: float = 0.05
    _shares: tuple[float, float, float] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if min(self.sessions, self.work, self.kv) < 0 or self.sessions + self.work + self.kv == 0:
            raise ValueError("load weights must be non-negative, and one of them positive")
        total = self.sessions + self.work + self.kv  # the weights, normalised once (`of` is on the hot path)
        object.__setattr__(self, "_shares", (self.sessions / total, self.work / total, self.kv / total))

    def of(self, node: NodeLoad, view: ClusterView, *, joining: int = 0) -> float:
        """`node`'s load, with `joining` more sessions on it (and in the cluster)."""
        n = len(view)
        sessions, work, kv = self._shares
        mean_sessions = (view.total_sessions + joining) / n
        load = sessions * (node.sessions + joining) / (mean_sessions if mean_sessions > 1.0 else 1.0)
        if work:
            load += work * (node.work + self.work_floor) / (view.total_work / n + self.work_floor)
        if kv:
            load += kv * (node.kv + self.kv_floor) / (view.total_kv / n + self.kv_floor)
        return load


class StickyPolicy(RoutingPolicy):
    """Keep a session on its node while that node's load is within `load_factor` x the mean; place new
    sessions by consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018).

    Past the bound, a session whose cache is cold moves first: it would be recomputed anyway, so it goes
    where the load is least (of `choices` nodes drawn at random). A warm one stays until its node passes
    `warm_factor`, the last resort. `cold_moves=False` ignores coldness (every session moves past
    `load_factor`, by the ring): the policy before it.
    """

    def __init__(
        self,
        load_factor: float = 1.25,
        weights: dict[str, float] | None = None,
        warm_factor: float | None = None,
        cold_moves: bool = True,
        choices: int = 3,
        seed: int | None = None,
    ) -> None:
        if load_factor < 1 or choices < 1:
            raise ValueError("load_factor must be at least 1, and choices at least 1")
        self.load_factor = load_factor
        self.warm_factor = max(load_factor, warm_factor if warm_factor is not None else load_factor)
        self.model = LoadModel(**(weights or {}))
        self.cold_moves = cold_moves
        self.choices = choices
        self._random = random.Random(seed)  # noqa: S311 (load spreading, not security)

    def choose(self, *, session_key: str, current: NodeLoad | None, view: ClusterView, cold: bool = False) -> Choice:
        if current is None:
            return self._place(session_key, view, None, "bounded-load hash")
        load = self.model.of(current, view)
        cold = cold and self.cold_moves
        if load <= self.load_factor or len(view) == 1 or (not cold and load <= self.warm_factor):
            return Choice(current.name, "sticky")
        if cold:
            target = self._least_of_sample(view, current.name)
            if self._fits(target, view, 1.0):
                return Choice(target.name, "cold, rebalanced")
        return self._place(session_key, view, current.name, "node overloaded")

    def _fits(self, node: NodeLoad, view: ClusterView, bound: float) -> bool:
        """Whether `node` stays within `bound` with one more session, and within `load_factor` x the mean
        number of sessions whatever the other figures say (so that sessions stay balanced while every
        node is idle)."""
        mean_sessions = max(1.0, (view.total_sessions + 1) / len(view))
        return node.sessions + 1 <= self.load_factor * mean_sessions and self.model.of(node, view, joining=1) <= bound

    def _least_of_sample(self, view: ClusterView, leaving: str) -> NodeLoad:
        """The least loaded of `choices` nodes drawn at random (other than `leaving`): "the power of d
        choices" (Mitzenmacher, 2001) balances nearly as well as a scan of every node, in O(d). A cold
        session's cache is lost wherever it goes, so its hash point does not matter, and each of its moves
        lands somewhere new: a hot session spreads its turns instead of bouncing between ring neighbours."""
        drawn = [view.get(self._random.choice(view.names)) for _ in range(self.choices)]
        drawn = [n for n in drawn if n.name != leaving] or [view.least_loaded(besides=leaving)]
        return min(drawn, key=lambda n: self.model.of(n, view, joining=1))

    def _place(self, key: str, view: ClusterView, leaving: str | None, reason: str) -> Choice:
        """The first node on the ring from `key` (other than `leaving`) whose load with the session stays
        within the bound, else the node with the fewest sessions. Bounded loads keep the walk short: a node
        is passed only if it is full, and most are not."""
        for steps, name in enumerate(view.ring_walk(key)):
            if name != leaving and self._fits(view.get(name), view, self.load_factor):
                return Choice(name, reason)
            if steps >= 2 * view.replicas:  # a crowded ring: stop walking
                break
        return Choice(view.least_loaded(besides=leaving).name, "least loaded")


class RoundRobinPolicy(RoutingPolicy):
    """Baseline: every turn to the next node in turn (per process), ignoring where the cache is."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, *, session_key: str, current: NodeLoad | None, view: ClusterView, cold: bool = False) -> Choice:
        return Choice(view.names[next(self._counter) % len(view)], "round robin")


class LeastLoadedPolicy(RoutingPolicy):
    """Baseline: every turn to the node with the fewest sessions."""

    def choose(self, *, session_key: str, current: NodeLoad | None, view: ClusterView, cold: bool = False) -> Choice:
        return Choice(view.least_loaded().name, "least loaded")


class RandomPolicy(RoutingPolicy):
    """Baseline: every turn to a node chosen at random (seedable for replays)."""

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)  # noqa: S311 (load spreading, not security)

    def choose(self, *, session_key: str, current: NodeLoad | None, view: ClusterView, cold: bool = False) -> Choice:
        return Choice(self._random.choice(view.names), "random")
