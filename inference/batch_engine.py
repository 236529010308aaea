"""Continuous batching over one llama.cpp context, with a session-keyed KV cache.

One engine thread owns the context. Each step the scheduler (`inference.scheduler`) plans a single
`llama_decode` batch: one token for each running sequence that is decoding, or a chunk of the oldest
prompt under the step's token budget (chunked prefill, so a long prompt never stalls the others), the two
kinds taking turns; the engine decodes it, counts it (`EngineMetrics.observe_step`) and samples. A
finished sequence leaves and a waiting request joins at the next step (iteration-level scheduling, Orca,
OSDI '22). Requests come from any thread through `submit`. Text goes to each request's `on_text` from the
engine thread as soon as it is sampled; the result (or an error) goes back through the request's event
queue to the waiting caller.
"""

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from inference.chat_format import chat_format_for_model
from inference.config import EngineConfig
from inference.engine_metrics import EngineMetrics
from inference.kv_disk import DiskTier, DiskUsage
from inference.llama_runtime import LlamaRuntime, NoKVSlot
from inference.request import Request, RequestState
from inference.scheduler import Scheduler
from inference.session_cache import Residency, SessionCache
from inference.text_stream import TextAssembler
from inference.types import FinishReason, Generation, NodeStats, Sampling, check_fits

logger = logging.getLogger(__name__)

# How often the engine looks for an idle session to write to the disk tier.
WRITE_BEHIND_INTERVAL_S = 0.2


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
        self.disk = self._open_disk_tier()
        self.sessions = SessionCache(
            self.runtime,
            n_seq=config.MAX_RESIDENT_SESSIONS,
            spill_budget_bytes=config.SPILL_BUDGET_MB * 2**20,
            disk=self.disk,
        )
        self.kv_store = f"{socket.gethostname()}:{self.disk.root.resolve()}" if self.disk is not None else ""
        self._draining = False
        self._next_write_behind = 0.0
        self.scheduler = Scheduler(config, self.runtime, self.sessions)
        self._inbox: queue.Queue[Request] = queue.Queue()
        self._ending: queue.Queue[str] = queue.Queue()  # sessions to forget (engine thread)
        self._ending_later: set[str] = set()  # ... once their running request has ended
        self._stats = self._collect_stats()
        self.metrics = EngineMetrics()
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
        self,
        *,
        session_key: str,
        prompt: Sequence[int],
        sampling: Sampling,
        on_text: Callable[[str], bool] | None = None,
        stop: threading.Event | None = None,
    ) -> Request:
        """Queue a request for the engine thread; `on_text` and `stop` are as in `generate` (one already set
        ends the request at admission)."""
        check_fits(len(prompt), sampling.max_tokens, self.n_ctx)
        if not prompt:
            raise ValueError("The prompt is empty.")
        stop = threading.Event() if stop is None else stop
        if self.disk is not None and not stop.is_set() and not self.sessions.holds(session_key):
            self.disk.prefetch(session_key)  # the file is read here, off the engine thread
        request = Request(
            session_key=session_key, prompt=list(prompt), sampling=sampling, on_text=on_text, cancelled=stop
        )
        self._inbox.put(request)
        return request

    def generate(
        self,
        *,
        session_key: str,
        prompt: Sequence[int],
        sampling: Sampling,
        on_text: Callable[[str], bool] | None = None,
        stop: threading.Event | None = None,
    ) -> Generation:
        """Submit and wait for the result.

        `on_text` gets each piece of the reply as it is sampled, on the engine thread: it must be quick and
        never block, and it answers whether to go on (False stops the request at the next step). Handing
        text over there costs no wake-up of the waiting thread per token. `stop`, set from any thread, ends
        the request at its next step: the engine thread reads it every step, so the waiting thread sleeps
        until the result, with no polling (a timed wait costs CPU on the cores llama.cpp needs).
        """
        request = self.submit(session_key=session_key, prompt=prompt, sampling=sampling, on_text=on_text, stop=stop)
        kind, payload = request.events.get()
        if kind == "done":
            return payload
        raise payload  # "error"

    def stats(self) -> NodeStats:
        return self._stats

    def end_session(self, session_key: str) -> None:
        """Forget the session's state, in the context, in RAM and on disk, soon (after a request it runs)."""
        self._ending.put(session_key)

    def session_places(self, limit: int) -> dict[str, str]:
        places = {key: place.value for key, place in self.sessions.places().items()}
        on_disk = self.disk.sessions() if self.disk is not None else []
        listed = {**places, **{key: Residency.DISK.value for key in on_disk if key not in places}}
        return dict(list(listed.items())[:limit])

    def sessions_dropped(self) -> list[str]:
        dropped = self.sessions.dropped
        return [dropped.popleft() for _ in range(len(dropped))]  # popleft is safe beside the engine's appends

    def set_draining(self, draining: bool) -> None:
        """A draining node's sessions move elsewhere: write each to the disk tier as soon as it is idle."""
        self._draining = draining

    def close(self) -> None:
        """Stop the engine; with a disk tier, write every resident session's new tokens first."""
        self._closed.set()
        self._thread.join(timeout=10)
        if self.disk is not None:
            if not self._thread.is_alive():  # else a step is stuck in llama.cpp: the context is not ours
                self.sessions.persist_all()
            self.disk.close()
        self.runtime.close()

    def _open_disk_tier(self) -> DiskTier | None:
        config = self.config
        if not config.KV_DISK_PATH or config.KV_DISK_BUDGET_MB <= 0:
            return None
        disk = DiskTier(
            Path(config.KV_DISK_PATH) / self.model,  # one directory per model: its nodes share it
            budget_bytes=config.KV_DISK_BUDGET_MB * 2**20,
            fingerprint=self.runtime.state_fingerprint(),
            writer=config.NODE_NAME,
        )
        usage = disk.scan()
        logger.info("KV disk tier %s holds %d sessions (%.1f MiB)", disk.root, usage.sessions, usage.bytes / 2**20)
        return disk

    # Engine thread -------------------------------------------------------------

    def _loop(self) -> None:
        if self.config.COMPUTE_NICE:
            # This thread, and the OpenMP threads llama.cpp starts from it at the first decode, give way to
            # the node's other threads and the processes beside it (web, Postgres, Redis): their work is
            # short and on a turn's critical path, and the compute threads take every cycle left.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.config.COMPUTE_NICE)
        while not self._closed.is_set():
            self._take_new(block=not self.scheduler.has_work)
            admission = self.scheduler.admit()
            for request in admission.cancelled:
                self._hand_back(request, "cancelled")
            for request in admission.started:
                request.sampler = self.runtime.sampler(request.sampling, request.prompt)
                request.text = TextAssembler(request.sampling.stop)
            if self.scheduler.running:
                try:
                    self._step()
                except Exception as exc:  # a broken step must not take the node down
                    logger.exception("engine step failed")
                    for request in list(self.scheduler.running):
                        self._fail(request, exc)
            self._write_behind()
            self._end_sessions()
            self._stats = self._collect_stats()

    def _end_sessions(self) -> None:
        try:
            while True:
                self._ending_later.add(self._ending.get_nowait())
        except queue.Empty:
            pass
        if self._ending_later:
            self._ending_later = {key for key in self._ending_later if not self.sessions.forget(key)}

    def _write_behind(self) -> None:
        """Hand the disk tier one idle session's new tokens, a few times a second at most: the copy out of
        the context runs here, between steps; the file is written on the tier's own thread."""
        now = time.monotonic()
        if self.disk is None or now < self._next_write_behind:
            return
        self._next_write_behind = now + WRITE_BEHIND_INTERVAL_S
        if self._draining:
            self.sessions.persist_idle(idle_since=now, limit=1)
        elif self.config.KV_DISK_IDLE_S > 0:
            self.sessions.persist_idle(idle_since=now - self.config.KV_DISK_IDLE_S, limit=1)

    def _take_new(self, *, block: bool) -> None:
        try:
            if block:
                self.scheduler.add(self._inbox.get(timeout=0.2))
            while True:
                self.scheduler.add(self._inbox.get_nowait())
        except queue.Empty:
            pass

    def _step(self) -> None:
        """Schedule, decode, sample: one iteration of continuous batching."""
        for request in list(self.scheduler.running):
            if request.cancelled.is_set() and not request.finished:
                self._finish(request, "cancelled")
        plan = self.scheduler.schedule()
        if not plan.entries:
            return
        started = time.perf_counter()
        try:
            self.runtime.decode(plan.entries)
        except NoKVSlot:
            if not self.sessions.spill_one_idle():
                raise
            self.runtime.decode(plan.entries)
        self.metrics.observe_step(plan.kind, len(plan.entries), time.perf_counter() - started)
        for chunk in self.scheduler.update(plan):
            assert chunk.request.sampler is not None and chunk.logits_index is not None
            self._accept_token(chunk.request, self.runtime.sample(chunk.request.sampler, chunk.logits_index))

    def _accept_token(self, request: Request, token: int) -> None:
        assert request.text is not None
        if not request.first_token_at:
            request.first_token_at = time.perf_counter()
        if token in self.chat_format.stop_token_ids and not request.sampling.ignore_eos:
            self._finish(request, "stop")
            return
        request.generated.append(token)
        request.last_token = token
        if text := request.text.add(self.runtime.piece(token)):
            self._emit(request, text)
        if request.text.stopped:
            del request.generated[request.text.kept_tokens :]
            self._finish(request, "stop")
        elif len(request.generated) >= request.sampling.max_tokens:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Hand the result back now; the request leaves the batch once its last token is in the cache."""
        request.state = RequestState.FINISHING
        self._hand_back(request, reason)
        if request.last_token is None:
            self.scheduler.release(request)

    def _emit(self, request: Request, text: str) -> None:
        """The text to the request's `on_text`; a False answer stops it, an exception fails it."""
        if request.on_text is None:
            return
        try:
            go_on = request.on_text(text)
        except Exception as exc:
            request.on_text = None  # nothing more to a callback that failed
            request.events.put(("error", exc))  # its caller raises it and stops waiting
            go_on = False
        if go_on is False:
            request.cancel()

    def _hand_back(self, request: Request, reason: FinishReason) -> None:
        if request.text is not None and (tail := request.text.finish()):
            self._emit(request, tail)
        generation = self._generation(request, reason)
        self.metrics.observe(generation)
        request.events.put(("done", generation))

    def _fail(self, request: Request, exc: Exception) -> None:
        request.events.put(("error", exc))
        self.scheduler.drop(request)

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
            cache_source=request.residency.value if request.cached_tokens else "none",
            queue_ms=((request.admitted_at or end) - request.submitted_at) * 1000,
            prefill_ms=((request.prefilled_at or end) - (request.admitted_at or end)) * 1000,
            ttft_ms=(first - request.submitted_at) * 1000,
            decode_tokens_per_s=(decoded - 1) / (end - first) if decoded > 1 and end > first else 0.0,
        )

    def _collect_stats(self) -> NodeStats:
        disk = self.disk.usage() if self.disk is not None else DiskUsage()
        return NodeStats(
            running=sum(1 for r in self.scheduler.running if not r.finished),
            waiting=len(self.scheduler.waiting) + self._inbox.qsize(),
            resident_sessions=len(self.sessions.resident_sessions()),
            spilled_sessions=self.sessions.spilled_count(),
            kv_cells_used=self.sessions.cells_used(),
            kv_cells_total=self.runtime.kv_size,
            spilled_bytes=self.sessions.spilled_bytes,
            disk_sessions=disk.sessions,
            disk_bytes=disk.bytes,
        )
