"""Session-keyed KV cache: which session owns which sequence, and spilling to host RAM.

A session (a conversation) keeps its tokens' KV state between turns. While
resident it owns a sequence id in the llama.cpp context; when room is needed
the least recently used idle session's state is copied to host RAM (and
dropped from RAM, oldest first, beyond a byte budget). A returning session
is restored from RAM when that beats recomputing its prefix.
"""

import ctypes
import heapq
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import Enum

from inference.llama_runtime import LlamaRuntime

# Below this many reusable tokens, recomputing is one cheap prefill chunk: drop the spilled state instead.
MIN_RESTORE_TOKENS = 32


class Residency(Enum):
    KEPT = "kept"  # it was resident already
    RESTORED = "restored"  # its spilled state was copied back from host RAM
    EMPTY = "empty"  # new, dropped, or not worth restoring: its prompt is computed afresh


@dataclass(eq=False)
class Session:
    key: str
    # The tokens whose KV state this session holds (resident or spilled), position by position.
    tokens: list[int] = field(default_factory=list)
    seq_id: int | None = None
    spilled: ctypes.Array | None = None
    busy: bool = False

    @property
    def resident(self) -> bool:
        return self.seq_id is not None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class SessionCache:
    def __init__(self, runtime: LlamaRuntime, *, n_seq: int, spill_budget_bytes: int) -> None:
        self._runtime = runtime
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        # Lowest first: running sequences then tend to have consecutive ids, which llama.cpp decodes in one
        # micro-batch (see Scheduler.schedule).
        self._free_seq_ids = list(range(n_seq))
        self._spill_budget = spill_budget_bytes
        self.spilled_bytes = 0
        self.restores = 0
        self.spills = 0

    def get(self, key: str) -> Session:
        """The session for `key` (new and empty if unknown), marked most recently used."""
        session = self._sessions.get(key)
        if session is None:
            session = self._sessions[key] = Session(key)
        self._sessions.move_to_end(key)
        return session

    # The token ledger: a session's tokens and busy flag change here only.

    def acquire(self, session: Session) -> None:
        """Mark the session as running a request (one at a time)."""
        assert not session.busy, f"session {session.key} already runs a request"
        session.busy = True

    def release(self, session: Session) -> None:
        session.busy = False

    def truncate(self, session: Session, keep: int) -> None:
        """Keep the first `keep` tokens of a resident session's sequence; drop the rest from the KV cache."""
        assert session.seq_id is not None
        self._runtime.seq_truncate(session.seq_id, keep)
        del session.tokens[keep:]

    def extend(self, session: Session, tokens: list[int]) -> None:
        """Record tokens a decode step has just written into the session's sequence."""
        session.tokens.extend(tokens)

    def resident_sessions(self) -> list[Session]:
        return [s for s in self._sessions.values() if s.resident]

    def cells_used(self) -> int:
        return sum(len(s.tokens) for s in self._sessions.values() if s.resident)

    def spilled_count(self) -> int:
        return sum(1 for s in self._sessions.values() if s.spilled is not None)

    def spill_one_idle(self, *, keep: Session | None = None) -> bool:
        """Spill the least recently used idle resident session other than `keep`; False if there is none."""
        for session in self._sessions.values():
            if session.resident and not session.busy and session is not keep:
                self._spill(session)
                return True
        return False

    def make_resident(self, session: Session, prompt: list[int]) -> Residency | None:
        """Give `session` a sequence id, restoring its spilled state if worth it; None if every sequence is busy.

        Returns with `session.tokens` equal to what its sequence really holds.
        """
        if session.resident:
            return Residency.KEPT
        if not self._free_seq_ids and not self.spill_one_idle(keep=session):
            return None
        session.seq_id = heapq.heappop(self._free_seq_ids)
        if session.spilled is not None:
            state, session.spilled = session.spilled, None
            self.spilled_bytes -= len(state)
            if common_prefix(session.tokens, prompt) >= MIN_RESTORE_TOKENS and self._runtime.seq_restore(
                session.seq_id, state
            ):
                self.restores += 1
                return Residency.RESTORED
            self._runtime.seq_truncate(session.seq_id, 0)
        session.tokens = []
        return Residency.EMPTY

    def discard(self, session: Session) -> None:
        """Forget a session's cached state (after a failed decode left it unknown)."""
        if session.resident:
            assert session.seq_id is not None
            self._runtime.seq_truncate(session.seq_id, 0)
            heapq.heappush(self._free_seq_ids, session.seq_id)
            session.seq_id = None
        session.tokens = []

    def _spill(self, session: Session) -> None:
        assert session.seq_id is not None
        if session.tokens:
            session.spilled = self._runtime.seq_save(session.seq_id)
            self.spilled_bytes += len(session.spilled)
            self.spills += 1
        self._runtime.seq_truncate(session.seq_id, 0)
        heapq.heappush(self._free_seq_ids, session.seq_id)
        session.seq_id = None
        self._enforce_spill_budget()

    def _enforce_spill_budget(self) -> None:
        dropped = []
        for session in self._sessions.values():
            if self.spilled_bytes <= self._spill_budget:
                break
            if session.spilled is not None:
                self.spilled_bytes -= len(session.spilled)
                dropped.append(session.key)
        for key in dropped:
            del self._sessions[key]
