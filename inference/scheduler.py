"""Which requests run, and what each of them puts into the next decode step.

The scheduler owns the waiting queue, the running batch and the session cache; every change to a
session's token ledger goes through the cache. Each step the engine asks for a plan (`schedule`), decodes
its entries, and hands the plan back (`update`), which says where to sample: the shape of vLLM's
`EngineCore.step` (schedule, execute, update from output). A request moves through explicit states
(`inference.request.RequestState`), as llama.cpp server's slots do.
"""

import time
from collections import deque
from dataclasses import dataclass

from inference.config import EngineConfig
from inference.llama_runtime import BatchEntry, LlamaRuntime
from inference.request import Request, RequestState
from inference.session_cache import Session, SessionCache, common_prefix
from inference.types import StepKind


@dataclass(frozen=True)
class Chunk:
    """What one step writes into one request's sequence."""

    request: Request
    tokens: list[int]
    logits_index: int | None  # the batch entry whose logits give the request's next token, if any


@dataclass(frozen=True)
class StepPlan:
    kind: StepKind
    entries: list[BatchEntry]
    chunks: list[Chunk]


@dataclass(frozen=True)
class Admission:
    started: list[Request]  # now in the batch, prefilling
    cancelled: list[Request]  # cancelled while waiting: the engine hands back their (empty) result


class Scheduler:
    def __init__(self, config: EngineConfig, runtime: LlamaRuntime, sessions: SessionCache) -> None:
        self.config = config
        self.runtime = runtime
        self.sessions = sessions
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._prefilled_last = False  # the last step planned was a prompt's chunk: decoding goes next

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def admit(self) -> Admission:
        """Move waiting requests into the batch, in arrival order, while they fit. A session runs one
        request at a time: its next one waits, and later sessions' requests may pass it."""
        admission = Admission(started=[], cancelled=[])
        skipped: list[Request] = []
        while self.waiting and len(self.running) < self.config.MAX_CONCURRENT:
            request = self.waiting.popleft()
            if request.cancelled.is_set():
                request.state = RequestState.DONE
                admission.cancelled.append(request)
                continue
            session = self.sessions.get(request.session_key)
            if session.busy:
                skipped.append(request)
                continue
            request.admitted_at = time.perf_counter()  # prefill_ms counts a restore from RAM too
            residency = (
                self.sessions.make_resident(session, request.prompt, reuse=request.sampling.cache_prompt)
                if self._reserve_cells(request, session)
                else None
            )
            if residency is None:
                self.waiting.appendleft(request)
                break
            request.residency = residency
            self._start(request, session)
            admission.started.append(request)
        self.waiting.extendleft(reversed(skipped))
        return admission

    def schedule(self) -> StepPlan:
        """The next step's entries: either one token for each decoding request (and each finishing one, whose
        last token still goes into the KV cache), or a chunk of the oldest prompt under the step's token
        budget (chunked prefill, so a long prompt never stalls the others), taking turns while both wait.

        Never both in one step, and one prompt at a time: with a KV stream per sequence, llama.cpp splits a
        batch into micro-batches that take as many tokens from each sequence, so a prompt chunk beside
        sequences that decode one token would have its first token decoded as a row of its own. llama.cpp's
        CPU attention sums one row apart from two or more, so that token's KV, and the reply, would depend
        on what decoded beside it (tests/inference/test_batch_invariance.py). The split also cost a second
        pass over the weights, so a step of each costs about what the mixed step did.

        Entries go in sequence-id order: llama.cpp's micro-batches take consecutive sequence ids, and each
        reads all the weights again (16 sequences in arrival order took 1.65x as long as the same 16
        sorted)."""
        decoding = [request for request in self.running if request.last_token is not None]
        oldest = next((r for r in self.running if r.state is RequestState.PREFILLING), None)  # admission order
        self._prefilled_last = oldest is not None and not (decoding and self._prefilled_last)
        if oldest is not None and self._prefilled_last:
            tokens = {id(oldest): oldest.pending[: _chunk_size(len(oldest.pending), self.config.step_token_budget)]}
        else:
            tokens = {id(request): [request.last_token] for request in decoding}  # type: ignore[list-item]
        entries: list[BatchEntry] = []
        chunks: list[Chunk] = []
        for request in sorted(self.running, key=_seq_id):
            chunk = tokens.get(id(request))
            if chunk is None:
                continue
            start, seq_id = len(request.session.tokens), _seq_id(request)  # type: ignore[union-attr]
            if request.state is RequestState.PREFILLING:
                wants_logits = len(chunk) == len(request.pending)  # the chunk ends the prompt
            else:
                wants_logits = request.state is RequestState.DECODING
            for i, token in enumerate(chunk):
                entries.append(BatchEntry(token, start + i, seq_id, wants_logits and i == len(chunk) - 1))
            chunks.append(Chunk(request, chunk, len(entries) - 1 if wants_logits else None))
        return StepPlan("prefill" if self._prefilled_last else "decode", entries, chunks)

    def update(self, plan: StepPlan) -> list[Chunk]:
        """Record a decoded step in the ledger and move requests on; the chunks to sample a token from."""
        now = time.perf_counter()
        to_sample: list[Chunk] = []
        for chunk in plan.chunks:
            request = chunk.request
            self.sessions.extend(request.session, chunk.tokens)  # type: ignore[arg-type]
            if request.state is RequestState.PREFILLING:
                del request.pending[: len(chunk.tokens)]
                if not request.pending:
                    request.prefilled_at = now
                    request.state = RequestState.DECODING
            else:
                request.last_token = None
            if request.state is RequestState.FINISHING:
                self.release(request)
            elif chunk.logits_index is not None:
                to_sample.append(chunk)
        return to_sample

    def release(self, request: Request) -> None:
        """The request leaves the batch; its session may run its next one."""
        request.state = RequestState.DONE
        if request.session is not None:
            self.sessions.release(request.session)
        request.free_sampler()
        self.running.remove(request)

    def drop(self, request: Request) -> None:
        """Release a request whose step failed, and forget its session's cache: its state is unknown."""
        if request.session is not None:
            self.sessions.discard(request.session)
        self.release(request)

    def _reserve_cells(self, request: Request, session: Session) -> bool:
        """With one shared pool, spill idle sessions until this request's cells fit next to the running ones."""
        if not self.config.KV_UNIFIED:
            return True  # every resident session has its own N_CTX-cell stream
        reusable = _reusable(request, session) if session.resident else 0
        need = len(request.prompt) - reusable + request.sampling.max_tokens + 1
        headroom = self.runtime.batch_capacity  # llama.cpp places a batch in free cells; keep room to place one
        while self.sessions.cells_used() + sum(r.cells_to_come() for r in self.running) + need + headroom > (
            self.runtime.kv_size
        ):
            if not self.sessions.spill_one_idle(keep=session):
                return False
        return True

    def _start(self, request: Request, session: Session) -> None:
        # The last prompt token is decoded again for its logits.
        reuse = min(_reusable(request, session), len(request.prompt) - 1)
        self.sessions.truncate(session, reuse)
        self.sessions.acquire(session)
        request.session = session
        request.cached_tokens = reuse
        request.pending = request.prompt[reuse:]
        request.state = RequestState.PREFILLING
        self.running.append(request)


def _chunk_size(pending: int, budget: int) -> int:
    """How many of a prompt's `pending` tokens go into a step with `budget` tokens: as many as fit, but
    never a chunk of one token that the budget made, nor one token left over for a chunk of its own (one
    row takes another path through llama.cpp's attention, see `Scheduler.schedule`). A prompt with one
    token to go is one row whatever is running."""
    take = min(pending, max(budget, 2))
    if pending - take == 1:
        take = take - 1 if take > 2 else pending
    return take


def _reusable(request: Request, session: Session) -> int:
    """The prompt's first tokens the session holds, unless the request asks for a cold prefill."""
    return common_prefix(session.tokens, request.prompt) if request.sampling.cache_prompt else 0


def _seq_id(request: Request) -> int:
    assert request.session is not None and request.session.seq_id is not None
    return request.session.seq_id
