"""The node's engine: takes a session key, prompt tokens and sampling, gives back tokens and measurements.

`Engine` is the small interface the rest of the product depends on; the
implementation behind it can change (a single `Llama` here, a batched,
session-keyed engine later) without touching callers.
"""

import codecs
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from inference.chat_format import GemmaChatFormat
from inference.config import EngineConfig
from inference.model_files import resolve_model_path

FinishReason = Literal["stop", "length", "cancelled"]


class PromptTooLong(ValueError):
    """The prompt plus the reply budget does not fit in the context."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float
    top_p: float
    repeat_penalty: float


@dataclass(frozen=True)
class Generation:
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    prompt_tokens: int
    cached_tokens: int
    prefill_ms: float
    ttft_ms: float
    decode_tokens_per_s: float


class Engine(Protocol):
    name: str
    n_ctx: int
    chat_format: GemmaChatFormat

    def default_sampling(self) -> Sampling: ...

    def generate(
        self,
        *,
        session_key: str,
        prompt: Sequence[int],
        sampling: Sampling,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Generation: ...


def check_fits(prompt_tokens: int, max_tokens: int, n_ctx: int) -> None:
    if prompt_tokens + max_tokens > n_ctx:
        raise PromptTooLong(
            f"The prompt is {prompt_tokens} tokens; with a {max_tokens}-token reply it exceeds "
            f"the model's {n_ctx}-token context."
        )


class LlamaEngine:
    """One `llama_cpp.Llama` holding one sequence; requests are served one at a time.

    It reuses the longest common prefix with the previous request, whichever
    session that was, so sessions sharing a node evict each other.
    """

    name = "llama"

    def __init__(self, config: EngineConfig) -> None:
        from llama_cpp import Llama

        self.config = config
        self._llm = Llama(
            model_path=str(resolve_model_path(config.MODEL_PATH)),
            n_ctx=config.N_CTX,
            n_threads=config.N_THREADS or None,
            n_gpu_layers=config.N_GPU_LAYERS,
            swa_full=True,
            verbose=False,
        )
        self.n_ctx = self._llm.n_ctx()
        self.chat_format = GemmaChatFormat(self._llm)
        self._lock = threading.Lock()

    def default_sampling(self) -> Sampling:
        return Sampling(
            max_tokens=self.config.MAX_REPLY_TOKENS,
            temperature=self.config.TEMPERATURE,
            top_p=self.config.TOP_P,
            repeat_penalty=self.config.REPEAT_PENALTY,
        )

    def generate(
        self,
        *,
        session_key: str,
        prompt: Sequence[int],
        sampling: Sampling,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Generation:
        check_fits(len(prompt), sampling.max_tokens, self.n_ctx)
        with self._lock:
            return self._generate_locked(prompt, sampling, on_text, should_stop)

    def _generate_locked(
        self,
        prompt: Sequence[int],
        sampling: Sampling,
        on_text: Callable[[str], None] | None,
        should_stop: Callable[[], bool] | None,
    ) -> Generation:
        llm = self._llm
        cached = _common_prefix(llm.input_ids[: llm.n_tokens].tolist(), prompt)
        # Llama.generate replays the last prompt token when the whole prompt is cached.
        cached = min(cached, len(prompt) - 1)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stop_ids = self.chat_format.stop_token_ids
        generated: list[int] = []
        finish: FinishReason = "length"
        start = time.perf_counter()
        first_token_at = start
        for token in llm.generate(
            prompt,
            temp=sampling.temperature,
            top_p=sampling.top_p,
            repeat_penalty=sampling.repeat_penalty,
        ):
            if not generated:
                first_token_at = time.perf_counter()
            if token in stop_ids:
                finish = "stop"
                break
            generated.append(token)
            piece = decoder.decode(llm.detokenize([token]))
            if piece and on_text:
                on_text(piece)
            if len(generated) >= sampling.max_tokens:
                break
            if should_stop and should_stop():
                finish = "cancelled"
                break
        end = time.perf_counter()
        tail = decoder.decode(b"", final=True)
        if tail and on_text:
            on_text(tail)
        decode_s = end - first_token_at
        return Generation(
            token_ids=generated,
            text=llm.detokenize(generated).decode("utf-8", errors="replace"),
            finish_reason=finish,
            prompt_tokens=len(prompt),
            cached_tokens=cached,
            prefill_ms=(first_token_at - start) * 1000,
            ttft_ms=(first_token_at - start) * 1000,
            decode_tokens_per_s=(len(generated) - 1) / decode_s if len(generated) > 1 and decode_s > 0 else 0.0,
        )


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


_engine: Engine | None = None
_engine_lock = threading.Lock()


def get_engine() -> Engine:
    """The process's engine, loaded once (at node start) and shared by all task threads."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = LlamaEngine(EngineConfig())
        return _engine
