"""BATCH_INVARIANT on the real model: a sequence's logits do not depend on what decodes beside it."""

import numpy as np
import pytest

from inference.llama_runtime import BatchEntry, LlamaRuntime
from tests.conftest import SMALL_ENGINE

TEXT = b"Hello there, how are you doing today? I am fine, thanks for asking. "
CONTEXT = 600  # past 512 cells, where llama.cpp's CPU flash attention splits a lone sequence's cells


def _alone_and_beside_another(runtime: LlamaRuntime) -> tuple[np.ndarray, np.ndarray]:
    """The logits of one token after CONTEXT tokens, decoded alone, then (in an identical sequence) beside
    a third sequence that decodes the same token."""
    text = TEXT * 60
    context = runtime.tokenize(text)[:CONTEXT]
    for seq in (0, 1, 2):
        for start in range(0, CONTEXT, 64):
            chunk = context[start : start + 64]
            runtime.decode([BatchEntry(token, start + i, seq, False) for i, token in enumerate(chunk)])
    token = context[1]
    runtime.decode([BatchEntry(token, CONTEXT, 0, True)])
    alone = runtime.logits(0).copy()
    runtime.decode([BatchEntry(token, CONTEXT, 1, True), BatchEntry(token, CONTEXT, 2, True)])
    return alone, runtime.logits(0).copy()


@pytest.mark.parametrize(
    ("flash_attn", "model", "invariant"),
    [
        ("auto", None, True),  # the default: off while BATCH_INVARIANT
        # What the default avoids, and the settings refuse (a copy is not validated): if llama.cpp ever sums
        # both ways alike, FLASH_ATTN=auto may follow llama.cpp again.
        ("on", None, False),
        # 8-bit weights: one row goes through llama.cpp's one-row dot products, two or more through its tiled
        # kernels (tinyBLAS), which must sum alike.
        ("auto", "smollm2-135m-instruct-q8_0", True),
    ],
)
def test_a_sequence_decodes_the_same_alone_or_beside_others(model_file, flash_attn, model, invariant):
    served = {"MODEL": model, "MODEL_PATH": ""} if model else {}
    runtime = LlamaRuntime(SMALL_ENGINE.model_copy(update={"FLASH_ATTN": flash_attn, **served}))
    try:
        alone, beside = _alone_and_beside_another(runtime)
    finally:
        runtime.close()
    assert np.array_equal(alone, beside) is invariant


PROMPT = 120


def _prefilled(runtime: LlamaRuntime, seq: int, chunks: list[int], beside: int | None = None) -> np.ndarray:
    """The logits of a prompt's last token after it was decoded in `chunks`; with `beside`, the second
    chunk shares its step with that sequence decoding one token (sequence ids in order, as the engine's)."""
    prompt = runtime.tokenize(TEXT * 20)[:PROMPT]
    assert sum(chunks) == PROMPT
    runtime.seq_truncate(seq, 0)
    if beside is not None:
        runtime.seq_truncate(beside, 0)
        runtime.decode([BatchEntry(t, i, beside, False) for i, t in enumerate(prompt[:30])])
    start = 0
    for k, n in enumerate(chunks):
        last = start + n == PROMPT
        entries = [BatchEntry(t, start + i, seq, last and i == n - 1) for i, t in enumerate(prompt[start:][:n])]
        if beside is not None and k == 1:
            entries.append(BatchEntry(prompt[30], 30, beside, False))
        runtime.decode(entries)
        start += n
    return runtime.logits(chunks[-1] - 1).copy()


def _cut(tokens: int) -> list[int]:
    """Chunks that fit SMALL_ENGINE's step of 64 with a token beside, none of one token."""
    return [60, tokens - 60] if tokens > 60 else [tokens]


def test_a_prompt_decodes_the_same_in_any_chunks_of_two_tokens_or_more(model_file):
    """How a prompt is cut into chunks depends on where its cached part ends and on the step's budget, and
    that changes nothing. What the scheduler avoids does: a chunk of one token, or a chunk beside sequences
    that decode one token (which llama.cpp splits so that the chunk's first token is a row of its own).
    One row takes another path through llama.cpp's attention, and its sums can come out apart, here at
    some of the places such a row could fall."""
    runtime = LlamaRuntime(SMALL_ENGINE)
    try:
        whole = _prefilled(runtime, 0, [64, 56])
        for chunks in ([40, 2, 64, 14], [63, 2, 55], [2] * 60, [3] * 40, [64, 54, 2]):
            assert np.array_equal(_prefilled(runtime, 1, chunks), whole), chunks
        alone = [_prefilled(runtime, 1, [at, 1, *_cut(PROMPT - at - 1)]) for at in (40, 47, 50, 55, 63)]
        assert any(not np.array_equal(logits, whole) for logits in alone)
        # A chunk beside a sequence that decodes one token: llama.cpp's micro-batches take one token from each.
        beside = [_prefilled(runtime, 1, [at, *_cut(PROMPT - at)], beside=2) for at in (40, 47, 50, 55, 63)]
        assert any(not np.array_equal(logits, whole) for logits in beside)
    finally:
        runtime.close()
