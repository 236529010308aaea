"""What the scheduler puts into a step, on the real model's context (nothing is decoded here)."""

from collections.abc import Iterator

import pytest

from inference.config import EngineConfig
from inference.llama_runtime import LlamaRuntime
from inference.request import Request, RequestState
from inference.scheduler import Scheduler
from inference.session_cache import SessionCache
from inference.types import Sampling
from tests.conftest import SMALL_ENGINE

GREEDY = Sampling(max_tokens=8, temperature=0, top_p=1, repeat_penalty=1.0)


@pytest.fixture(scope="module")
def runtime(model_file) -> Iterator[LlamaRuntime]:
    runtime = LlamaRuntime(SMALL_ENGINE.replace(STEP_TOKEN_BUDGET=64))
    yield runtime
    runtime.close()


def _scheduler(runtime: LlamaRuntime, *prompt_lengths: int, budget: int = 64) -> Scheduler:
    """A scheduler whose batch holds one new request per length, admitted in that order."""
    config = SMALL_ENGINE.replace(STEP_TOKEN_BUDGET=budget)
    scheduler = Scheduler(
        config, runtime, SessionCache(runtime, n_seq=config.MAX_RESIDENT_SESSIONS, spill_budget_bytes=0)
    )
    for k, length in enumerate(prompt_lengths):
        scheduler.add(Request(session_key=f"s{k}", prompt=list(range(100, 100 + length)), sampling=GREEDY))
    assert len(scheduler.admit().started) == len(prompt_lengths)
    return scheduler


def _planned(scheduler: Scheduler) -> list[tuple[str, int]]:
    return [(chunk.request.session_key, len(chunk.tokens)) for chunk in scheduler.schedule().chunks]


def test_one_prompt_a_step_the_oldest_first_in_chunks_under_the_budget(runtime):
    assert _planned(_scheduler(runtime, 20, 30)) == [("s0", 20)]
    assert _planned(_scheduler(runtime, 100, 30)) == [("s0", 64)]


def _decoding(scheduler: Scheduler, count: int) -> None:
    """The first `count` requests are past their prompts, each with a sampled token to decode."""
    for request in scheduler.running[:count]:
        request.state, request.pending, request.last_token = RequestState.DECODING, [], 7


def test_decoding_and_a_prompt_take_turns_never_sharing_a_step(runtime):
    """A prompt chunk beside one-token rows would be split by llama.cpp, its first token decoded alone."""
    scheduler = _scheduler(runtime, 10, 10, 200)
    _decoding(scheduler, 2)
    steps = []
    for _ in range(4):
        plan = scheduler.schedule()
        steps.append((plan.kind, [(chunk.request.session_key, len(chunk.tokens)) for chunk in plan.chunks]))
        scheduler.update(plan)
        for request in scheduler.running[:2]:
            request.last_token = 7  # sampled again
    prefill, decode = ("prefill", [("s2", 64)]), ("decode", [("s0", 1), ("s1", 1)])
    assert steps == [prefill, decode, prefill, decode]


@pytest.mark.parametrize(
    ("prompt", "budget", "planned"),
    [
        (65, 64, 63),  # not 64, which would leave one token for a step of its own
        (66, 64, 64),
        (3, 2, 3),  # not 2 and then 1: a token over the budget
        (1, 64, 1),  # a prompt with one token to go is one row whatever else runs
    ],
)
def test_a_prompt_chunk_is_never_one_token_that_the_budget_made(runtime, prompt, budget, planned):
    assert _planned(_scheduler(runtime, prompt, budget=budget)) == [("s0", planned)]


def test_the_default_budget_is_small_on_a_cpu_and_large_with_a_gpu():
    assert EngineConfig(STEP_TOKEN_BUDGET=0, N_GPU_LAYERS=0).step_token_budget == 64
    assert EngineConfig(STEP_TOKEN_BUDGET=0, N_GPU_LAYERS=-1).step_token_budget == 512
    assert EngineConfig(STEP_TOKEN_BUDGET=200, N_GPU_LAYERS=-1).step_token_budget == 200
