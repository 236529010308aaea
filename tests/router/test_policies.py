"""Routing policies in isolation: balance and stability of bounded-load consistent hashing."""

import random
from collections import Counter

import pytest
from django.core.exceptions import ImproperlyConfigured

from router import registry
from router.policies import ClusterView, LoadModel, NodeLoad, RandomPolicy, RoundRobinPolicy, StickyPolicy
from router.services import prefix_routing_key


def place(policy, sessions: list[str], names: list[str]) -> dict[str, str]:
    view = ClusterView(NodeLoad(name, 0) for name in names)
    placed = {}
    for key in sessions:
        choice = policy.choose(session_key=key, current=None, view=view)
        placed[key] = choice.node
        view.add_sessions(choice.node, 1)
    return placed


def test_bounded_load_hashing_keeps_every_node_within_the_bound():
    names = [f"n{i}" for i in range(8)]
    placed = place(StickyPolicy(load_factor=1.25), [f"s{i}" for i in range(2000)], names)
    loads = Counter(placed.values())
    assert max(loads.values()) <= 1.25 * 2000 / 8 + 1
    assert set(loads) == set(names)


def test_removing_a_node_moves_few_other_sessions():
    names = [f"n{i}" for i in range(8)]
    sessions = [f"s{i}" for i in range(800)]
    before = place(StickyPolicy(load_factor=1.5), sessions, names)
    after = place(StickyPolicy(load_factor=1.5), sessions, names[:-1])
    moved_elsewhere = [s for s in sessions if before[s] != "n7" and after[s] != before[s]]
    assert len(moved_elsewhere) < 0.25 * len(sessions)


class CountingView(ClusterView):
    looked_at = 0

    def get(self, name: str) -> NodeLoad:
        self.looked_at += 1
        return super().get(name)


def test_placement_looks_at_a_few_nodes_not_every_node():
    """Bounded-load placement walks the ring from the session's point: O(log n) for the walk's start, then
    only the nodes it passes, however many there are."""
    view = CountingView((NodeLoad(f"n{i}", 100) for i in range(1000)), replicas=64)
    policy = StickyPolicy(load_factor=1.25)
    for i in range(200):
        choice = policy.choose(session_key=f"s{i}", current=None, view=view)
        view.add_sessions(choice.node, 1)
    assert view.looked_at < 200 * 5


def test_sticky_keeps_the_current_node_until_it_is_overloaded():
    policy = StickyPolicy(load_factor=1.25, cold_moves=False)
    view = ClusterView([NodeLoad("a", 10), NodeLoad("b", 10)])
    assert policy.choose(session_key="s", current=view.get("a"), view=view).node == "a"
    view = ClusterView([NodeLoad("a", 30), NodeLoad("b", 10)])
    choice = policy.choose(session_key="s", current=view.get("a"), view=view)
    assert (choice.node, choice.reason) == ("b", "node overloaded")


def test_load_weighs_the_engines_work_beside_the_sessions():
    """Equal sessions, but one node runs and queues four times the requests: it is the loaded one."""
    model = LoadModel(sessions=1, work=2, kv=1)
    view = ClusterView([NodeLoad("hot", 10, work=16, kv=0.5), NodeLoad("calm", 10, work=4, kv=0.5)])
    assert model.of(view.get("hot"), view) > 1.25 > model.of(view.get("calm"), view)
    # A nearly idle cluster: one running request is no overload.
    idle = ClusterView([NodeLoad("a", 10, work=1), NodeLoad("b", 10, work=0)])
    assert model.of(idle.get("a"), idle) < 1.25
    with pytest.raises(ValueError, match="non-negative"):
        LoadModel(sessions=0, work=0, kv=0)


def test_past_the_bound_cold_sessions_move_and_warm_ones_stay_until_the_last_resort():
    policy = StickyPolicy(load_factor=1.25, warm_factor=2.0, seed=1)
    view = ClusterView([NodeLoad("a", 15), NodeLoad("b", 10), NodeLoad("c", 5)])  # a: 1.5x the mean
    assert policy.choose(session_key="s", current=view.get("a"), view=view).node == "a"
    cold = policy.choose(session_key="s", current=view.get("a"), view=view, cold=True)
    assert cold.node != "a" and cold.reason == "cold, rebalanced"
    view = ClusterView([NodeLoad("a", 25), NodeLoad("b", 3), NodeLoad("c", 2)])  # a: 2.5x the mean
    assert policy.choose(session_key="s", current=view.get("a"), view=view).reason == "node overloaded"
    # Within the bound, cold or not, a session stays.
    view = ClusterView([NodeLoad("a", 11), NodeLoad("b", 9), NodeLoad("c", 7)])  # a: 1.22x
    assert policy.choose(session_key="s", current=view.get("a"), view=view, cold=True).node == "a"


def test_cold_moves_go_where_the_load_is_least_and_spread_a_hot_session():
    """A cold session leaving a loaded node goes to the least loaded of the nodes drawn, not to its ring
    neighbour: over many moves a hot session visits many nodes."""
    policy = StickyPolicy(load_factor=1.25, choices=3, seed=1)
    names = [f"n{i}" for i in range(10)]
    visited: Counter[str] = Counter()
    for _ in range(200):
        view = ClusterView(NodeLoad(n, 20 if n == "n0" else 10) for n in names)
        visited[policy.choose(session_key="hot", current=view.get("n0"), view=view, cold=True).node] += 1
    assert "n0" not in visited and len(visited) == 9
    view = ClusterView([NodeLoad("a", 30, work=20), NodeLoad("b", 10, work=20), NodeLoad("c", 10)])
    weighted = StickyPolicy(weights={"sessions": 1, "work": 2}, choices=8, seed=1)
    assert weighted.choose(session_key="s", current=view.get("a"), view=view, cold=True).node == "c"


def test_the_view_keeps_means_and_the_least_loaded_node_as_loads_change():
    view = ClusterView([NodeLoad("a", 3, work=1.0), NodeLoad("b", 1), NodeLoad("c", 2)])
    assert (view.mean_sessions, view.least_loaded().name) == (2, "b")
    view.add_sessions("b", 5)
    view.update(NodeLoad("a", 0, work=3.0))
    assert (view.mean_sessions, view.mean_work, view.least_loaded().name) == (8 / 3, 1.0, "a")
    assert view.least_loaded(besides="a").name == "c"
    assert sorted(view.ring_walk("s")) == ["a", "b", "c"]
    assert view.only(["b", "x"]).names == ("b",)


def test_baselines_spread_without_affinity():
    view = ClusterView([NodeLoad("a", 0), NodeLoad("b", 0)])
    current = view.get("a")
    round_robin = RoundRobinPolicy()
    assert [round_robin.choose(session_key="s", current=current, view=view).node for _ in range(4)] == ["a", "b"] * 2
    draws = [RandomPolicy(seed=1), RandomPolicy(seed=1)]
    first, second = ([p.choose(session_key="s", current=current, view=view).node for _ in range(40)] for p in draws)
    assert first == second  # seeded: a replay is reproducible
    assert set(first) == {"a", "b"}


def test_prefix_routing_key_is_stable_and_distinguishes_prefixes():
    assert prefix_routing_key([2, 105, 2364]) == prefix_routing_key([2, 105, 2364])
    assert prefix_routing_key([2, 105, 2364]) != prefix_routing_key([2, 105, 2365])
    assert prefix_routing_key("system+hello").startswith("prefix:")


def test_a_bad_alias_or_backend_is_named(settings):
    with pytest.raises(ImproperlyConfigured, match="no alias 'nope'"):
        registry.build("ROUTER_POLICIES", "nope")
    settings.ROUTER_POLICIES = {"broken": {"BACKEND": "router.policies.Missing"}}
    assert registry.check_all("ROUTER_POLICIES") == [
        "ROUTER_POLICIES['broken']: cannot import BACKEND 'router.policies.Missing'."
    ]


def test_the_least_loaded_node_besides_one_is_never_that_one():
    view = ClusterView([NodeLoad("a", 0), NodeLoad("b", 5)])
    view.least_loaded()  # the buckets are built
    view.add_sessions("a", 1)
    view.add_sessions("a", -1)
    assert view.least_loaded().name == "a"
    assert view.least_loaded(besides="a").name == "b"  # the fewest are "a" alone: the next count up
    assert ClusterView([NodeLoad("a", 3)]).least_loaded(besides="a").name == "a"  # no other


def test_of_nodes_with_as_few_sessions_the_least_loaded_is_the_one_that_has_had_that_many_longest():
    view = ClusterView([NodeLoad("a", 1), NodeLoad("b", 1), NodeLoad("c", 1)])
    assert view.least_loaded().name == "a"  # built in name order
    view.add_sessions("a", 1)
    assert view.least_loaded().name == "b"
    view.add_sessions("b", 1)
    view.add_sessions("a", -1)  # back to 1, after "c"
    assert [view.least_loaded().name, view.least_loaded(besides="c").name] == ["c", "a"]


def test_the_least_loaded_node_matches_a_scan_of_every_node_through_random_changes():
    """The view's buckets against the fewest sessions of a scan of every node, after each of thousands of
    moves (one-session steps) and updates (jumps of any size)."""
    rng = random.Random(3)
    names = [f"n{i}" for i in range(12)]
    view = ClusterView(NodeLoad(n, rng.randrange(5)) for n in names)
    for step in range(3000):
        least = view.least_loaded()
        assert least == view.get(least.name), step
        assert least.sessions == min(view.get(n).sessions for n in names), step
        besides = rng.choice(names)
        other = view.least_loaded(besides=besides)
        assert other.name != besides, step
        assert other.sessions == min(view.get(n).sessions for n in names if n != besides), step
        if rng.random() < 0.6:  # a move, as a baseline makes: onto the least loaded, off another node
            view.add_sessions(least.name, 1)
            view.add_sessions(rng.choice(names), -1)
        else:
            name = rng.choice(names)
            view.update(NodeLoad(name, max(0, view.get(name).sessions + rng.randrange(-3, 4)), work=rng.random()))
