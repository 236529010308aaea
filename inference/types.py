"""What a generation asks for and gives back, shared by the engine's modules and their callers.

A leaf module: it imports nothing else from `inference`, so that the engine interface, the batch engine and
llama.cpp's wrapper all depend on it and not on one another.
"""

from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled"]
# A decode step either decodes one token for each running sequence or prefills one prompt's chunk.
StepKind = Literal["decode", "prefill"]
STEP_KINDS: tuple[StepKind, ...] = ("decode", "prefill")


class PromptTooLong(ValueError):
    """The prompt plus the reply budget does not fit in a session's context."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    repeat_penalty: float
    seed: int | None = None
    stop: tuple[str, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # Write on past the template's end-of-turn tokens, to max_tokens (vLLM's and llama-server's
    # `ignore_eos`): fixed-length replies for benchmarks and for tests that need a long reply.
    ignore_eos: bool = False
    # False: compute the whole prompt, reusing no cached state, this session's or another's (llama-server's
    # `cache_prompt`): a cold prefill, for benchmarks that compare one with a warm one.
    cache_prompt: bool = True


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int  # prompt tokens whose KV state was reused rather than computed
    # Where the reused tokens came from: resident, ram, disk, other_node (a file another node wrote), or
    # none (nothing was reused).
    cache_source: str
    queue_ms: float  # waiting for a place in the batch
    prefill_ms: float
    ttft_ms: float  # from submission to the first token
    decode_tokens_per_s: float


@dataclass(frozen=True)
class NodeStats:
    """A snapshot the engine takes after each step, for the router and the admin."""

    running: int = 0
    waiting: int = 0
    resident_sessions: int = 0
    spilled_sessions: int = 0
    kv_cells_used: int = 0
    kv_cells_total: int = 0
    spilled_bytes: int = 0
    disk_sessions: int = 0  # files in the disk tier (shared with the nodes using the same directory)
    disk_bytes: int = 0


def check_fits(prompt_tokens: int, max_tokens: int, n_ctx: int) -> None:
    if prompt_tokens + max_tokens > n_ctx:
        raise PromptTooLong(
            f"The prompt is {prompt_tokens} tokens; with a {max_tokens}-token reply it exceeds "
            f"the model's {n_ctx}-token context."
        )
