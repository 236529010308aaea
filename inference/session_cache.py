"""Session-keyed KV cache: which session owns which sequence, and its tiers in host RAM and on disk.

A session (a conversation) keeps its tokens' KV state between turns. While
resident it owns a sequence id in the llama.cpp context; when room is needed
the least recently used idle session's state is copied to host RAM (and
dropped from RAM, oldest first, beyond a byte budget). With a disk tier
(`inference.kv_disk`) the spilled state is also written to disk, and so is an
idle session's (write-behind) and every resident one at a clean shutdown: a
restarted node, or another node sharing the directory, restores it from there.
A returning session is restored when that beats recomputing its prefix; a new one starts from the
prefix another resident session holds (a shared system prompt), as llama-server's slots reuse each other's.
"""

import ctypes
import heapq
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum

from inference.kv_disk import DiskTier
from inference.llama_runtime import LlamaRuntime

logger = logging.getLogger(__name__)

# Below this many reusable tokens, recomputing is one cheap prefill chunk: drop the spilled state instead.
MIN_RESTORE_TOKENS = 32
# A session with nothing cached starts from another resident session's cells when they share at least this
# much of its prompt (a system prompt, say; a chat template's first line alone is a few tokens). Copying a
# resident sequence's cells costs about 13 us a cell it holds (SmolLM2, 2 cores): 10 ms from an 800-token
# session, against 69 ms to compute 24 tokens on their own.
MIN_SHARED_TOKENS = 16
DROPPED_KEPT = 1000  # dropped sessions remembered between two heartbeats; older ones are simply not reported


class Residency(Enum):
    """Where a session's reusable tokens came from when its request started (`Generation.cache_source`)."""

    KEPT = "resident"  # it was resident already
    RAM = "ram"  # its spilled state was copied back from host RAM
    DISK = "disk"  # read from a file this node wrote (before a restart, too)
    OTHER_NODE = "other_node"  # read from a file another node sharing the disk tier wrote
    SHARED = "shared"  # copied from the prefix another resident session holds (a common system prompt)
    EMPTY = "none"  # new, dropped, or not worth restoring: its prompt is computed afresh


@dataclass(eq=False)
class Session:
    key: str
    # The tokens whose KV state this session holds (resident or spilled), position by position.
    tokens: list[int] = field(default_factory=list)
    seq_id: int | None = None
    spilled: ctypes.Array | None = None
    busy: bool = False
    version: int = 0  # bumped whenever `tokens` change
    persisted: int = -1  # the version last handed to the disk tier
    last_used: float = field(default_factory=time.monotonic)

    @property
    def resident(self) -> bool:
        return self.seq_id is not None

    @property
    def dirty(self) -> bool:
        """Holds tokens the disk tier does not have yet."""
        return bool(self.tokens) and self.persisted != self.version


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class SessionCache:
    def __init__(
        self, runtime: LlamaRuntime, *, n_seq: int, spill_budget_bytes: int, disk: DiskTier | None = None
    ) -> None:
        self._runtime = runtime
        self._disk = disk
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        # Lowest first: running sequences then tend to have consecutive ids, which llama.cpp decodes in one
        # micro-batch (see Scheduler.schedule).
        self._free_seq_ids = list(range(n_seq))
        self._spill_budget = spill_budget_bytes
        self.spilled_bytes = 0
        self.spills = 0
        # Sessions whose state left this node's memory (dropped from RAM; perhaps still on disk), oldest
        # first, until the heartbeat reports them: the router may then move them for free.
        self.dropped: deque[str] = deque(maxlen=DROPPED_KEPT)

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
        session.last_used = time.monotonic()

    def truncate(self, session: Session, keep: int) -> None:
        """Keep the first `keep` tokens of a resident session's sequence; drop the rest from the KV cache."""
        assert session.seq_id is not None
        self._runtime.seq_truncate(session.seq_id, keep)
        if keep < len(session.tokens):
            del session.tokens[keep:]
            session.version += 1

    def extend(self, session: Session, tokens: list[int]) -> None:
        """Record tokens a decode step has just written into the session's sequence."""
        session.tokens.extend(tokens)
        session.version += 1

    def holds(self, key: str) -> bool:
        """Whether `key`'s state is in the context or in RAM. Any thread may ask: the answer may be stale by
        the time the engine thread acts, which costs at most a needless read of its file."""
        session = self._sessions.get(key)
        return session is not None and (session.resident or session.spilled is not None)

    def places(self) -> dict[str, Residency]:
        """Where each session in memory is: resident in the context, or spilled to RAM. Any thread may ask
        (a snapshot of the dict, taken at once under the GIL)."""
        return {
            key: Residency.KEPT if s.resident else Residency.RAM
            for key, s in list(self._sessions.items())
            if s.resident or s.spilled is not None
        }

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

    def make_resident(self, session: Session, prompt: list[int], *, reuse: bool = True) -> Residency | None:
        """Give `session` a sequence id, restoring its spilled state if worth it; None if every sequence is busy.
        Without `reuse` (a cold prefill asked for) nothing is restored or shared: the request truncates it.

        Returns with `session.tokens` equal to what its sequence really holds.
        """
        if session.resident:
            return Residency.KEPT if reuse else Residency.EMPTY
        if not self._free_seq_ids and not self.spill_one_idle(keep=session):
            return None
        session.seq_id = heapq.heappop(self._free_seq_ids)
        if session.spilled is not None:
            state, session.spilled = session.spilled, None
            self.spilled_bytes -= len(state)
            if (
                reuse
                and common_prefix(session.tokens, prompt) >= MIN_RESTORE_TOKENS
                and self._runtime.seq_restore(session.seq_id, state)
            ):
                return Residency.RAM
            self._runtime.seq_truncate(session.seq_id, 0)
        elif reuse and (source := self._restore_from_disk(session, prompt)) is not None:
            return source
        self._set_tokens(session, [])
        return self._share_prefix(session, prompt) if reuse else Residency.EMPTY

    def _share_prefix(self, session: Session, prompt: list[int]) -> Residency:
        """Start the empty resident `session` from the longest prefix of `prompt` that another resident
        session holds, as llama-server gives a new request the slot whose cache shares most of its prompt;
        from the shortest such session, the cheapest to copy. EMPTY if none shares MIN_SHARED_TOKENS."""
        donor, shared = None, MIN_SHARED_TOKENS - 1
        for other in self._sessions.values():
            if other.resident and other is not session:
                n = common_prefix(other.tokens, prompt)
                if n > shared or (n == shared and donor is not None and len(other.tokens) < len(donor.tokens)):
                    donor, shared = other, n
        if donor is None:
            return Residency.EMPTY
        assert session.seq_id is not None and donor.seq_id is not None
        if not self._runtime.seq_copy_prefix(donor.seq_id, session.seq_id, shared):
            self._runtime.seq_truncate(session.seq_id, 0)
            return Residency.EMPTY
        self._set_tokens(session, prompt[:shared])
        return Residency.SHARED

    def discard(self, session: Session) -> None:
        """Forget a session's cached state (after a failed decode left it unknown)."""
        if session.resident:
            assert session.seq_id is not None
            self._runtime.seq_truncate(session.seq_id, 0)
            heapq.heappush(self._free_seq_ids, session.seq_id)
            session.seq_id = None
        self._set_tokens(session, [])

    def forget(self, key: str) -> bool:
        """Drop all that is kept for `key`: its sequence, its copy in RAM and its file (its conversation was
        deleted). False while it runs a request: ask again once that has ended."""
        session = self._sessions.get(key)
        if session is not None:
            if session.busy:
                return False
            if session.spilled is not None:
                self.spilled_bytes -= len(session.spilled)
                session.spilled = None
            self.discard(session)
            del self._sessions[key]
        if self._disk is not None:
            self._disk.discard(key)
        return True

    # The disk tier

    def persist_idle(self, *, idle_since: float, limit: int) -> int:
        """Hand the disk tier up to `limit` resident sessions that are idle since `idle_since` (monotonic) and
        hold tokens it lacks, least recently used first; how many were handed over."""
        if self._disk is None:
            return 0
        handed = 0
        for session in self._sessions.values():
            if handed >= limit:
                break
            if session.resident and not session.busy and session.dirty and session.last_used <= idle_since:
                self._persist(session, self._runtime.seq_save(session.seq_id))  # type: ignore[arg-type]
                handed += 1
        return handed

    def persist_all(self) -> int:
        """Hand every resident session's new tokens to the disk tier (at a clean shutdown)."""
        return self.persist_idle(idle_since=float("inf"), limit=len(self._sessions))

    def _persist(self, session: Session, state: ctypes.Array) -> None:
        if self._disk is not None and session.dirty:
            self._disk.put(session.key, list(session.tokens), state)
            session.persisted = session.version

    def _restore_from_disk(self, session: Session, prompt: list[int]) -> Residency | None:
        """Load the session's file into its (empty) sequence if it covers enough of the prompt."""
        if self._disk is None:
            return None
        stored = self._disk.load(session.key)
        if stored is None or common_prefix(stored.tokens, prompt) < MIN_RESTORE_TOKENS:
            return None
        assert session.seq_id is not None
        if not self._runtime.seq_restore(session.seq_id, stored.state):
            logger.warning("KV disk tier: llama.cpp refused the stored state of %s; deleting it", session.key)
            self._runtime.seq_truncate(session.seq_id, 0)
            self._disk.discard(session.key)
            return None
        self._set_tokens(session, stored.tokens)
        session.persisted = session.version  # the disk has exactly these tokens
        return Residency.DISK if stored.writer == self._disk.writer else Residency.OTHER_NODE

    def _set_tokens(self, session: Session, tokens: list[int]) -> None:
        session.tokens = tokens
        session.version += 1

    def _spill(self, session: Session) -> None:
        assert session.seq_id is not None
        if session.tokens:
            session.spilled = self._runtime.seq_save(session.seq_id)
            self.spilled_bytes += len(session.spilled)
            self.spills += 1
            self._persist(session, session.spilled)
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
        self.dropped.extend(dropped)
