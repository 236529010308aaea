"""Routing policies: which healthy node serves a session's next turn.

A policy is one small class with one method, `choose`, given the session, the
node it is on now (if that node is healthy) and the healthy nodes with their
loads. Aliases are configured in `settings.ROUTER_POLICIES`, like `CACHES`.
"""

import bisect
import hashlib
import itertools
import math
import random
from dataclasses import dataclass
from functools import lru_cache


@dataclass(frozen=True)
class NodeLoad:
    name: str
    load: int  # sessions assigned to it


@dataclass(frozen=True)
class Choice:
    node: str
    reason: str


def _hash(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest())


class RoutingPolicy:
    sticky = False  # keeps a session where its prefix is cached

    def keeps(self, *, load: int, mean: float) -> bool:
        """Whether a session stays on its healthy current node at this load, whatever the other nodes hold."""
        return False

    def choose(self, *, session_key: str, current: str | None, nodes: list[NodeLoad]) -> Choice:
        """Pick from `nodes` (healthy, non-empty); `current` is the session's node if it is among them."""
        raise NotImplementedError


class StickyPolicy(RoutingPolicy):
    """Keep a session on its node while that node's load is at most `load_factor` x the healthy mean;
    otherwise place it by consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam, 2018)."""

    sticky = True

    def __init__(self, load_factor: float = 1.25, replicas: int = 64) -> None:
        if load_factor < 1:
            raise ValueError("load_factor must be at least 1")
        self.load_factor = load_factor
        self.replicas = replicas

    def keeps(self, *, load: int, mean: float) -> bool:
        return load <= self.load_factor * max(mean, 1)

    def choose(self, *, session_key: str, current: str | None, nodes: list[NodeLoad]) -> Choice:
        mean = sum(n.load for n in nodes) / len(nodes)
        if current is not None and self.keeps(load=next(n.load for n in nodes if n.name == current), mean=mean):
            return Choice(current, "sticky")
        # The session joins a node: bound each node by c x the mean load after it joins.
        bound = math.ceil(self.load_factor * (sum(n.load for n in nodes) + 1) / len(nodes))
        loads = {n.name: n.load for n in nodes}
        for name in _ring_walk(tuple(sorted(loads)), self.replicas, _hash(session_key)):
            if name != current and loads[name] + 1 <= bound:
                return Choice(name, "node overloaded" if current else "bounded-load hash")
        others = [n for n in nodes if n.name != current] or nodes
        return Choice(min(others, key=lambda n: (n.load, n.name)).name, "least loaded")


@lru_cache(maxsize=64)
def _ring(names: tuple[str, ...], replicas: int) -> tuple[list[int], list[str]]:
    points = sorted((_hash(f"{name}#{i}"), name) for name in names for i in range(replicas))
    return [p for p, _ in points], [n for _, n in points]


def _ring_walk(names: tuple[str, ...], replicas: int, start: int):
    """Distinct node names clockwise from `start` on the hash ring."""
    hashes, owners = _ring(names, replicas)
    seen: set[str] = set()
    i = bisect.bisect(hashes, start)
    for k in range(len(owners)):
        name = owners[(i + k) % len(owners)]
        if name not in seen:
            seen.add(name)
            yield name


class RoundRobinPolicy(RoutingPolicy):
    """Baseline: every turn to the next node in turn (per process), ignoring where the cache is."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, *, session_key: str, current: str | None, nodes: list[NodeLoad]) -> Choice:
        return Choice(nodes[next(self._counter) % len(nodes)].name, "round robin")


class LeastLoadedPolicy(RoutingPolicy):
    """Baseline: every turn to the node with the fewest sessions."""

    def choose(self, *, session_key: str, current: str | None, nodes: list[NodeLoad]) -> Choice:
        return Choice(min(nodes, key=lambda n: (n.load, n.name)).name, "least loaded")


class RandomPolicy(RoutingPolicy):
    """Baseline: every turn to a node chosen at random (seedable for replays)."""

    def __init__(self, seed: int | None = None) -> None:
        self._random = random.Random(seed)  # noqa: S311 (load spreading, not security)

    def choose(self, *, session_key: str, current: str | None, nodes: list[NodeLoad]) -> Choice:
        return Choice(self._random.choice(nodes).name, "random")
