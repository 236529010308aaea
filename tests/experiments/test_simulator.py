"""The cluster simulator's invariants, on hand-made workloads (no model, no database)."""

import math
import random

import pytest

from chatapp.experiments.simulator import NodeProfile, SimSession, SimTurn, Simulation, sessions_from_profiles
from router.policies import LeastLoadedPolicy, RandomPolicy, RoundRobinPolicy, StickyPolicy

PROFILE = NodeProfile(prefill_tokens_per_s=300, step_ms_one=20, step_ms_per_extra=6, slots=4, kv_tokens=math.inf)


def growing_session(key: str, turns: int, *, think_s: float = 1.0) -> SimSession:
    """A conversation resent in full: each prompt extends the previous prompt and its reply."""
    shape, prompt = [], 40
    for t in range(turns):
        shape.append(SimTurn(prompt, prompt - 30 if t else 0, 16, think_s if t else 0.0))
        prompt += 16 + 30
    return SimSession(key, tuple(shape), start_s=0.0)


def random_sessions(count: int, seed: int = 0) -> list[SimSession]:
    rng = random.Random(seed)
    profiles = [
        [
            SimTurn(rng.randint(20, 400), rng.randint(0, 20), rng.randint(1, 64), rng.random() * 5)
            for _ in range(rng.randint(1, 6))
        ]
        for _ in range(50)
    ]
    return sessions_from_profiles(profiles, count=count, rate_per_s=2.0, seed=seed)


@pytest.mark.parametrize("policy", [StickyPolicy(), RoundRobinPolicy(), LeastLoadedPolicy(), RandomPolicy(seed=1)])
@pytest.mark.parametrize("concurrency", [None, 3])
def test_every_request_is_served_exactly_once(policy, concurrency):
    sessions = random_sessions(300)
    result = Simulation(profile=PROFILE, nodes=5, policy=policy, sessions=sessions, concurrency=concurrency).run()
    turns = sum(len(s.turns) for s in sessions)
    assert (
        result.requests
        == result.completed
        == turns
        == sum(result.node_turns)
        == len(result.latency_s)
        == len(result.ttft_s)
    )
    assert result.prompt_tokens == sum(t.prompt_tokens for s in sessions for t in s.turns)
    assert all(ttft > 0 for ttft in result.ttft_s)
    assert all(latency >= ttft for latency, ttft in zip(sorted(result.latency_s), sorted(result.ttft_s), strict=True))


def test_one_session_per_node_with_unbounded_cache_reuses_everything_reusable():
    sessions = [growing_session(f"s{k}", 6) for k in range(4)]
    result = Simulation(profile=PROFILE, nodes=4, policy=StickyPolicy(), sessions=sessions).run()
    assert result.reusable_tokens > 0
    assert result.hit_tokens == result.reusable_tokens
    assert result.summary()["reuse_captured"] == 1.0
    assert result.node_sessions == [1, 1, 1, 1]


def test_a_small_cache_and_a_cache_blind_policy_lose_hits():
    sessions = [growing_session(f"s{k}", 6) for k in range(8)]
    sticky = Simulation(profile=PROFILE, nodes=4, policy=StickyPolicy(), sessions=sessions).run()
    spread = Simulation(profile=PROFILE, nodes=4, policy=RandomPolicy(seed=2), sessions=sessions).run()
    small = NodeProfile(300, 20, 6, 4, kv_tokens=200)
    squeezed = Simulation(profile=small, nodes=4, policy=StickyPolicy(), sessions=sessions).run()
    # Sticky moves a session only while the cluster fills and one node passes the load bound.
    assert sticky.hit_tokens >= 0.9 * sticky.reusable_tokens
    assert spread.hit_tokens < 0.75 * sticky.hit_tokens
    assert squeezed.hit_tokens < sticky.hit_tokens


def test_latency_grows_with_offered_load():
    rng = random.Random(3)
    profiles = [[SimTurn(rng.randint(50, 300), 0, 32, 2.0) for _ in range(3)] for _ in range(40)]
    p50s = []
    for rate in (0.1, 1.0, 4.0, 16.0):
        sessions = sessions_from_profiles(profiles, count=400, rate_per_s=rate, seed=7)
        result = Simulation(profile=PROFILE, nodes=2, policy=StickyPolicy(), sessions=sessions).run()
        p50s.append(result.summary()["latency_ms_p50"])
    assert p50s == sorted(p50s) and p50s[-1] > 2 * p50s[0]


def test_sticky_sessions_stay_put_within_the_load_bound():
    sessions = random_sessions(2000)
    result = Simulation(profile=PROFILE, nodes=10, policy=StickyPolicy(load_factor=1.25), sessions=sessions).run()
    assert max(result.node_sessions) <= math.ceil(1.25 * 2000 / 10)
    assert sum(result.node_sessions) == 2000


def test_skewed_activity_gives_a_few_sessions_most_of_the_turns():
    profiles = [[SimTurn(100, 0, 16), SimTurn(160, 116, 16, 2.0)]]
    even = sessions_from_profiles(profiles, count=1000, rate_per_s=1.0, seed=3)
    skewed = sessions_from_profiles(profiles, count=1000, rate_per_s=1.0, seed=3, skew=1.2)
    assert {len(s.turns) for s in even} == {2}
    lengths = sorted((len(s.turns) for s in skewed), reverse=True)
    assert lengths[-1] == 2 and lengths[0] > 20
    assert sum(lengths[:100]) > 0.3 * sum(lengths)  # a tenth of the sessions send a third of the turns
    repeated = next(s for s in skewed if len(s.turns) > 2)
    assert repeated.turns[2].reusable_tokens < repeated.turns[1].prompt_tokens  # each repetition breaks its prefix


def test_work_aware_sticky_balances_turns_under_skew_and_moves_few_warm_sessions():
    """Against the session-count policy on a skewed workload: turns spread more evenly, the moves it makes
    are nearly all free ones, and the cache hit ratio holds."""
    profiles = [[growing_session("p", 6).turns[t] for t in range(6)]]
    sessions = sessions_from_profiles(profiles, count=600, rate_per_s=3.0, seed=5, skew=1.2)
    work_aware = StickyPolicy(weights={"sessions": 1, "work": 2, "kv": 1}, warm_factor=2.0, seed=1)
    by_sessions = StickyPolicy(cold_moves=False)
    new, old = (
        Simulation(profile=PROFILE, nodes=6, policy=policy, sessions=sessions).run().summary()
        for policy in (work_aware, by_sessions)
    )
    assert new["max_mean_turns"] < old["max_mean_turns"]
    assert new["warm_moves_per_turn"] <= 0.01
    assert new["cache_hit_ratio"] >= old["cache_hit_ratio"] - 0.01


def test_a_new_session_reuses_the_opening_only_on_a_node_holding_another_session():
    """Prefix sharing: a first turn reuses the opening every prompt shares (here 24 tokens) once its node
    holds another session, or when the node starts holding earlier sessions' state."""
    first_turn = (SimTurn(100, 0, 16, 0.0, 24),)
    sessions = [SimSession(f"s{i}", first_turn, start_s=10.0 * i) for i in range(3)]
    one_node = Simulation(profile=PROFILE, nodes=1, policy=StickyPolicy(), sessions=sessions).run()
    assert one_node.hit_tokens == 2 * 24  # the first session found nothing to share
    warm = Simulation(profile=PROFILE, nodes=1, policy=StickyPolicy(), sessions=sessions, held_opening=24).run()
    assert warm.hit_tokens == 3 * 24
    apart = Simulation(profile=PROFILE, nodes=3, policy=RoundRobinPolicy(), sessions=sessions).run()
    assert apart.hit_tokens == 0  # each on a node of its own
