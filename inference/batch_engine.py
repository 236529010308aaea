"""Continuous batching over one llama.cpp context, with a session-keyed KV cache.

One engine thread owns the context. Each step it builds a single
`llama_decode` batch from every running sequence: one token for each that is
decoding, then prefill chunks under the step's token budget (chunked prefill,
so a long prompt never stalls the others). A finished sequence leaves and a
waiting request joins at the next step (iteration-level scheduling, Orca,
OSDI '22). Requests come from any thread through `submit`; results go back
through each request's event queue.
"""

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llama_cpp._internals import LlamaSampler

from inference.chat_format import chat_format_for_model
from inference.config import EngineConfig
from inference.engine import FinishReason, Generation, NodeStats, Sampling, check_fits
from inference.llama_runtime import BatchEntry, LlamaRuntime, NoKVSlot
from inference.session_cache import Residency, Session, SessionCache, common_prefix
from inference.text_stream import TextAssembler

logger = logging.getLogger(__name__)

# How often a waiting caller polls its `should_stop` (a Redis read for a turn).
CANCEL_POLL_S = 0.1


@dataclass(eq=False)
class Request:
    session_key: str
    prompt: list[int]
    sampling: Sampling
    events: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted_at: float = field(default_factory=time.perf_counter)
    # Engine-thread state.
    session: Session | None = None
    sampler: LlamaSampler | None = None
    pending: list[int] = field(default_factory=list)  # prompt tokens not yet in the KV cache
    last_token: int | None = None  # sampled but not yet decoded into the KV cache
    generated: list[int] = field(default_factory=list)
    text: TextAssembler | None = None
    finished: bool = False
    cached_tokens: int = 0
    restored: bool = False
    admitted_at: float = 0.0
    prefilled_at: float = 0.0
    first_token_at: float = 0.0

    def cancel(self) -> None:
        self.cancelled.set()

    def cells_to_come(self) -> int:
        """KV cells this request may still add: the rest of its prompt and of its reply."""
        return len(self.pending) + (0 if self.finished else self.sampling.max_tokens - len(self.generated) + 1)


class BatchEngine:
    name = "batched"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runtime = LlamaRuntime(config)
        self.n_ctx = min(config.N_CTX, self.runtime.seq_capacity)
        self.model = self.runtime.model_file.name
        self.chat_format = chat_format_for_model(
            self.runtime,
            template=self.runtime.metadata().get("tokenizer.chat_template", ""),
            forced=self.runtime.model_file.chat_template,
        )
        self.sessions = SessionCache(
            self.runtime, n_seq=config.MAX_RESIDENT_SESSIONS, spill_budget_bytes=config.SPILL_BUDGET_MB * 2**20
        )
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._stats = NodeStats(kv_cells_total=self.runtime.kv_size)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    # Any thread ---------------------------------------------------------------

    def default_sampling(self) -> Sampling:
        return Sampling(
            max_tokens=self.config.MAX_REPLY_TOKENS,
            temperature=self.config.TEMPERATURE,
            top_p=self.config.TOP_P,
            repeat_penalty=self.config.REPEAT_PENALTY,
            ignore_eos=self.config.IGNORE_EOS,
        )

    def submit(
        self, *, session_key: str, prompt: Sequence[int], sampling: Sampling, cancelled: bool = False
    ) -> Request:
        """Queue a request for the engine thread; `cancelled` queues it already stopped (it ends at admission)."""
        check_fits(len(prompt), sampling.max_tokens, self.n_ctx)
        if not prompt:
            raise ValueError("The prompt is empty.")
        request = Request(session_key=session_key, prompt=list(prompt), sampling=sampling)
        if cancelled:
            request.cancel()
        self._inbox.put(request)
        return request

    def generate(
        self,
        *,
        session_key: str,
        prompt: Sequence[int],
        sampling: Sampling,
        on_text: Callable[[str], None] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> Generation:
        """Submit and wait: text pieces go to `on_text` from the calling thread, off the engine's loop."""
        stopped = bool(should_stop and should_stop())
        request = self.submit(session_key=session_key, prompt=prompt, sampling=sampling, cancelled=stopped)
        next_poll = time.monotonic() + CANCEL_POLL_S
        while True:
            if should_stop and not request.cancelled.is_set() and time.monotonic() >= next_poll:
                if should_stop():
                    request.cancel()
                next_poll = time.monotonic() + CANCEL_POLL_S
            try:
                kind, payload = request.events.get(timeout=CANCEL_POLL_S)
            except queue.Empty:
                continue
            if kind == "text":
                if on_text:
                    on_text(payload)
            elif kind == "done":
                return payload
            else:
                raise payload

    def stats(self) -> NodeStats:
        return self._stats

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=10)
        self.runtime.close()

    # Engine thread -------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closed.is_set():
            self._take_new(block=not (self._running or self._waiting))
            self._admit()
            if self._running:
                try:
                    self._step()
                except Exception as exc:  # a broken step must not take the node down
                    logger.exception("engine step failed")
                    for request in list(self._running):
                        self._fail(request, exc)
            self._stats = self._collect_stats()

    def _take_new(self, *, block: bool) -> None:
        try:
            if block:
                self._waiting.append(self._inbox.get(timeout=0.2))
            while True:
                self._waiting.append(self._inbox.get_nowait())
        except queue.Empty:
            pass

    def _admit(self) -> None:
        """Move waiting requests into the running batch, in arrival order, while they fit."""
        skipped: list[Request] = []
        while self._waiting and len(self._running) < self.config.MAX_CONCURRENT:
            request = self._waiting.popleft()
            if request.cancelled.is_set():
                self._finish(request, "cancelled")
                continue
            session = self.sessions.get(request.session_key)
            if session.busy:  # one request per session at a time; the next waits its turn
                skipped.append(request)
                continue
            request.admitted_at = time.perf_counter()  # prefill_ms counts a restore from RAM too
            residency = (
                self.sessions.make_resident(session, request.prompt) if self._reserve_cells(request, session) else None
            )
            if residency is None:
                self._waiting.appendleft(request)
                break
            request.restored = residency is Residency.RESTORED
            self._start(request, session)
        self._waiting.extendleft(reversed(skipped))

    def _reserve_cells(self, request: Request, session: Session) -> bool:
        """With one shared pool, spill idle sessions until this request's cells fit next to the running ones."""
        if not self.config.KV_UNIFIED:
            return True  # every resident session has its own N_CTX-cell stream
        reusable = common_prefix(session.tokens, request.prompt) if session.resident else 0
        need = len(request.prompt) - reusable + request.sampling.max_tokens + 1
        headroom = self.runtime.batch_capacity  # llama.cpp places a batch in free cells; keep room to place one
        while self.sessions.cells_used() + sum(r.cells_to_come() for r in self._running) + need + headroom > (
            self.runtime.kv_size
        ):
            if not self.sessions.spill_one_idle(keep=session):
                return False
        return True

    def _start(self, request: Request, session: Session) -> None:
        assert session.seq_id is not None
        reuse = common_prefix(session.tokens, request.prompt)
        reuse = min(reuse, len(request.prompt) - 1)  # the last prompt token is decoded again for its logits
        self.runtime.seq_truncate(session.seq_id, reuse)
        del session.tokens[reuse:]
        request.session = session
        request.cached_tokens = reuse
        request.pending = request.prompt[reuse:]
        request.sampler = self.runtime.sampler(request.sampling)
        request.text = TextAssembler(request.sampling.stop)
        session.busy = True
        self._running.append(request)

    def _step(self) -> None:
        for request in list(self._running):
            if request.cancelled.is_set() and not request.finished:
                self._finish(request, "cancelled")
        entries, plan = self._build_batch()
        if not entries:
            return
        try:
            self.runtime.decode(entries)
        except NoKVSlot:
            if not self.sessions.spill_one_idle():
                raise
            self.runtime.decode(entries)
        self._after_decode(plan)

    def _build_batch(self) -> tuple[list[BatchEntry], list[tuple[Request, list[int], int | None]]]:
        """Entries for one decode step, and per request: the tokens it adds and where its logits are.

        Decoding sequences come first for the step's token budget, prefill chunks take the rest. Entries go
        in sequence-id order: with one KV stream per sequence, llama.cpp splits a batch into micro-batches
        of consecutive sequence ids, and each micro-batch reads all the weights again (16 sequences in
        arrival order took 1.65x as long as the same 16 sorted)."""
        budget = self.config.STEP_TOKEN_BUDGET
        chunks: dict[int, list[int]] = {}
        for request in self._running:
            if request.last_token is not None:
                chunks[id(request)] = [request.last_token]
                budget -= 1
        for request in self._running:
            if request.pending and budget > 0:
                chunks[id(request)] = request.pending[:budget]
                budget -= len(chunks[id(request)])
        entries: list[BatchEntry] = []
        plan: list[tuple[Request, list[int], int | None]] = []
        for request in sorted(self._running, key=lambda r: r.session.seq_id):  # type: ignore[union-attr]
            chunk = chunks.get(id(request))
            if chunk is None:
                continue
            assert request.session is not None and request.session.seq_id is not None
            start = len(request.session.tokens)
            decoding = request.last_token is not None
            # A decoding sequence wants its next token's logits; a prefill chunk only when it ends the prompt.
            wants_logits = not request.finished if decoding else len(chunk) == len(request.pending)
            for i, token in enumerate(chunk):
                last = i == len(chunk) - 1
                entries.append(BatchEntry(token, start + i, request.session.seq_id, wants_logits and last))
            plan.append((request, chunk, len(entries) - 1 if wants_logits else None))
        return entries, plan

    def _after_decode(self, plan: list[tuple[Request, list[int], int | None]]) -> None:
        now = time.perf_counter()
        for request, tokens, logits_index in plan:
            assert request.session is not None
            request.session.tokens.extend(tokens)
            if request.pending:
                del request.pending[: len(tokens)]
                if not request.pending:
                    request.prefilled_at = now
            else:
                request.last_token = None
            if request.finished:
                self._release(request)
            elif logits_index is not None:
                assert request.sampler is not None
                self._accept_token(request, self.runtime.sample(request.sampler, logits_index))

    def _accept_token(self, request: Request, token: int) -> None:
        assert request.text is not None
        if not request.first_token_at:
            request.first_token_at = time.perf_counter()
        if token in self.chat_format.stop_token_ids and not request.sampling.ignore_eos:
            self._finish(request, "stop")
            return
        request.generated.append(token)
        request.last_token = token
        text = request.text.add(self.runtime.piece(token))
        if text:
            request.events.put(("text", text))
        if request.text.stopped:
            del request.generated[request.text.kept_tokens :]
            self._finish(request, "stop")
        elif len(request.generated) >= request.sampling.max_tokens:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Hand the result back now; the request leaves the batch once its last token is in the cache."""
        request.finished = True
        if request.text is not None and (tail := request.text.finish()):
            request.events.put(("text", tail))
        request.events.put(("done", self._generation(request, reason)))
        if request.last_token is None and request in self._running:
            self._release(request)

    def _release(self, request: Request) -> None:
        if request.session is not None:
            request.session.busy = False
        if request.sampler is not None:
            # Free llama.cpp's chain now: LlamaSampler is in a reference cycle, so without this its buffers
            # (about 1 MiB a request here) waited for the cyclic collector (the load test saw nodes grow).
            request.sampler.close()
            request.sampler = None
        self._running.remove(request)

    def _fail(self, request: Request, exc: Exception) -> None:
        request.finished = True
        request.events.put(("error", exc))
        if request.session is not None:
            self.sessions.discard(request.session)
        self._release(request)

    def _generation(self, request: Request, reason: FinishReason) -> Generation:
        end = time.perf_counter()
        first = request.first_token_at or end
        decoded = len(request.generated)
        return Generation(
            token_ids=list(request.generated),
            text=request.text.text if request.text else "",
            finish_reason=reason,
            prompt_tokens=len(request.prompt),
            cached_tokens=request.cached_tokens,
            restored=request.restored,
            queue_ms=((request.admitted_at or end) - request.submitted_at) * 1000,
            prefill_ms=((request.prefilled_at or end) - (request.admitted_at or end)) * 1000,
            ttft_ms=(first - request.submitted_at) * 1000,
            decode_tokens_per_s=(decoded - 1) / (end - first) if decoded > 1 and end > first else 0.0,
        )

    def _collect_stats(self) -> NodeStats:
        return NodeStats(
            running=sum(1 for r in self._running if not r.finished),
            waiting=len(self._waiting) + self._inbox.qsize(),
            resident_sessions=len(self.sessions.resident_sessions()),
            spilled_sessions=self.sessions.spilled_count(),
            kv_cells_used=self.sessions.cells_used(),
            kv_cells_total=self.runtime.kv_size,
            spilled_bytes=self.sessions.spilled_bytes,
        )
