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


def test_prompts_that_fit_share_a_step(runtime):
    assert _planned(_scheduler(runtime, 20, 30)) == [("s0", 20), ("s1", 30)]


def test_only_the_oldest_prompt_is_split_and_a_later_one_waits_for_a_step_it_fits_in_whole(runtime):
    scheduler = _scheduler(runtime, 40, 30, 10)
    # s1 (30) does not fit beside s0 (40) in 64 tokens: it waits; s2 (10) still fits.
    assert _planned(scheduler) == [("s0", 40), ("s2", 10)]
    scheduler = _scheduler(runtime, 100, 30)
    assert _planned(scheduler) == [("s0", 64)]  # the oldest takes the whole budget, in chunks


def _decoding(scheduler: Scheduler, count: int) -> None:
    """The first `count` requests are past their prompts, each with a sampled token to decode."""
    for request in scheduler.running[:count]:
        request.state, request.pending, request.last_token = RequestState.DECODING, [], 7


def test_decoding_sequences_take_their_token_first(runtime):
    scheduler = _scheduler(runtime, 10, 60)
    _decoding(scheduler, 1)
    assert _planned(scheduler) == [("s0", 1), ("s1", 60)]


def test_the_oldest_prompt_moves_on_when_decoding_takes_the_whole_budget(runtime):
    scheduler = _scheduler(runtime, 5, 5, 5, 30, budget=2)
    _decoding(scheduler, 3)
    # Two tokens, not one: a chunk of one token would take another path through llama.cpp's attention.
    assert _planned(scheduler) == [("s0", 1), ("s1", 1), ("s2", 1), ("s3", 2)]


@pytest.mark.parametrize(
    ("prompt", "decoding", "budget", "planned"),
    [
        (65, 0, 64, 63),  # not 64, which would leave one token for a step of its own
        (3, 2, 4, 3),  # not 2 and then 1: a token over the budget
        (40, 3, 4, 2),  # the budget leaves one
        (1, 3, 4, 1),  # a prompt with one token to go is one row whatever decodes beside it
    ],
)
def test_a_prompt_chunk_is_never_one_token_that_the_batch_made(runtime, prompt, decoding, budget, planned):
    scheduler = _scheduler(runtime, *[5] * decoding, prompt, budget=budget)
    _decoding(scheduler, decoding)
    assert _planned(scheduler)[-1] == (f"s{decoding}", planned)


def test_the_default_budget_is_small_on_a_cpu_and_large_with_a_gpu():
    assert EngineConfig(STEP_TOKEN_BUDGET=0, N_GPU_LAYERS=0).step_token_budget == 64
    assert EngineConfig(STEP_TOKEN_BUDGET=0, N_GPU_LAYERS=-1).step_token_budget == 512
    assert EngineConfig(STEP_TOKEN_BUDGET=200, N_GPU_LAYERS=-1).step_token_budget == 200
