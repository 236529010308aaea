"""One generation request as the engine tracks it: what was asked, where it stands, what it has made."""

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from llama_cpp._internals import LlamaSampler

from inference.greedy import PenalizedGreedy
from inference.session_cache import Residency, Session
from inference.text_stream import TextAssembler
from inference.types import Sampling


class RequestState(Enum):
    WAITING = "waiting"  # submitted, not in the batch yet
    PREFILLING = "prefilling"  # in the batch; prompt tokens still to go into the KV cache
    DECODING = "decoding"  # in the batch; one sampled token goes in each step
    FINISHING = "finishing"  # its result is handed back; its last sampled token still goes into the KV cache
    DONE = "done"  # out of the batch


@dataclass(eq=False)
class Request:
    session_key: str
    prompt: list[int]
    sampling: Sampling
    on_text: Callable[[str], bool] | None = None  # called on the engine thread (BatchEngine.generate)
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)  # ("done" | "error", payload)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)
    # Engine-thread state.
    state: RequestState = RequestState.WAITING
    session: Session | None = None
    sampler: LlamaSampler | PenalizedGreedy | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet in the KV cache
    last_token: int | None = None  # sampled, not yet in the KV cache
    generated: list[int] = field(default_factory=list)
    text: TextAssembler | None = None
    cached_tokens: int = 0
    residency: Residency = Residency.EMPTY  # where its reused tokens came from
    admitted_at: float = 0.0
    prefilled_at: float = 0.0
    first_token_at: float = 0.0

    def cancel(self) -> None:
        self.cancelled.set()

    @property
    def finished(self) -> bool:
        """Its result is handed back (it may still be writing its last token into the KV cache)."""
        return self.state in (RequestState.FINISHING, RequestState.DONE)

    def cells_to_come(self) -> int:
        """KV cells this request may still add: the rest of its prompt and of its reply."""
        return len(self.pending) + (0 if self.finished else self.sampling.max_tokens - len(self.generated) + 1)

    def free_sampler(self) -> None:
        """Free llama.cpp's sampler chain now: LlamaSampler is in a reference cycle, so without this its
        buffers (about 1 MiB a request here) waited for the cyclic collector (the load test saw nodes grow)."""
        if isinstance(self.sampler, LlamaSampler):
            self.sampler.close()
        self.sampler = None
