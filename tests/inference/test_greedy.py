"""The Python greedy sampler against llama.cpp's own chain (penalties, then greedy), on the real model."""

from collections.abc import Iterator, Sequence

import llama_cpp
import pytest
from llama_cpp._internals import LlamaSampler

from inference.greedy import PenalizedGreedy
from inference.llama_runtime import BatchEntry, LlamaRuntime
from inference.types import Sampling
from tests.conftest import SMALL_ENGINE

PROMPTS = [b"The list of fruits: apple, banana, apple, banana,", b"Repeat after me: the the the the the"]


@pytest.fixture(scope="module")
def runtime(model_file) -> Iterator[LlamaRuntime]:
    runtime = LlamaRuntime(SMALL_ENGINE)
    yield runtime
    runtime.close()


def _llama_chain(runtime: LlamaRuntime, sampling: Sampling, prompt: Sequence[int]) -> LlamaSampler:
    """llama-server's greedy: llama.cpp's penalties, then its greedy pick, the chain first fed the whole
    prompt (`init_sampler` in its server-context.cpp)."""
    chain = runtime.penalties(sampling)
    chain.add_greedy()
    for token in prompt:
        llama_cpp.llama_sampler_accept(chain.sampler, token)
    return chain


@pytest.mark.parametrize(
    "penalties",
    [
        {"repeat_penalty": 1.0},
        {"repeat_penalty": 1.1},
        {"repeat_penalty": 1.5, "presence_penalty": 0.5},
        {"repeat_penalty": 0.9, "frequency_penalty": 0.3, "presence_penalty": -0.2},
    ],
)
def test_it_picks_the_tokens_llama_cpp_picks(runtime, penalties):
    """Two sequences decoded side by side for 100 tokens, past the 64-token window; at every step both
    samplers read the same logits (llama.cpp's chain first: it copies them, ours penalises in place)."""
    sampling = Sampling(max_tokens=100, temperature=0, top_p=1, **penalties)
    prompts = [runtime.tokenize(text) for text in PROMPTS]
    ours = [runtime.sampler(sampling, prompt) for prompt in prompts]
    assert all(isinstance(sampler, PenalizedGreedy) for sampler in ours)
    reference = [_llama_chain(runtime, sampling, prompt) for prompt in prompts]
    entries = [
        BatchEntry(token, pos, seq, logits=pos == len(prompt) - 1)
        for seq, prompt in enumerate(prompts)
        for pos, token in enumerate(prompt)
    ]
    positions = [len(prompt) for prompt in prompts]
    penalised_steps = 0
    try:
        for _ in range(100):
            runtime.decode(entries)
            indexes = [i for i, entry in enumerate(entries) if entry.logits]
            entries = []
            for seq, index in enumerate(indexes):
                theirs = reference[seq].sample(runtime.context, index)
                plain = int(runtime.logits(index).argmax())
                token = ours[seq].choose(runtime.logits(index))
                assert token == theirs
                penalised_steps += token != plain
                entries.append(BatchEntry(token, positions[seq], seq, logits=True))
                positions[seq] += 1
    finally:
        for chain in reference:
            chain.close()
        for seq in range(len(prompts)):
            runtime.seq_truncate(seq, 0)
    if penalties != {"repeat_penalty": 1.0}:
        assert penalised_steps > 0  # the penalties changed the choice somewhere: the test compares them


def test_the_penalties_window_starts_with_the_prompt(runtime):
    """As llama-server's: the first token is already held back from repeating the prompt's last tokens."""
    sampling = Sampling(max_tokens=1, temperature=0, top_p=1, repeat_penalty=1.5)
    prompt = runtime.tokenize(PROMPTS[1])
    runtime.decode([BatchEntry(token, pos, 0, logits=pos == len(prompt) - 1) for pos, token in enumerate(prompt)])
    try:
        index = len(prompt) - 1
        plain = int(runtime.logits(index).argmax())
        assert plain in prompt[-64:]  # the model would repeat itself ...
        sampler = runtime.sampler(sampling, prompt)
        assert isinstance(sampler, PenalizedGreedy)
        primed = sampler.choose(runtime.logits(index).copy())
        assert primed != plain  # ... and the penalty over the prompt stops it
        assert PenalizedGreedy(sampling).choose(runtime.logits(index).copy()) == plain  # an empty window would not
    finally:
        runtime.seq_truncate(0, 0)
