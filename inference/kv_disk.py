"""The session KV cache's disk tier: one file per session, under a byte budget, shared by every node that
uses the same directory (nodes of one model on one machine, by default).

A file holds a header (the model and context settings it was computed for, the node that wrote it), the
session's token ids, and the sequence's state exactly as llama.cpp's `llama_state_seq_get_data` gives it.
A file is checked before its state is used: another model file, other context settings, a checksum that
does not match or a short file mean it is ignored, logged and deleted. The token ids say how much of a
prompt the state covers; the caller restores only a common prefix.

Files are written by one background thread (the engine thread only hands over a buffer it already has),
to a temporary name and then renamed, so a reader never sees half a file. Reads can happen ahead, on the
thread that submits a request (`prefetch`), so the engine thread only copies the state into the context.
Beyond the budget the least recently used files go first: a read touches a file's time, and the writer
enforces the budget over the whole directory, whichever node wrote the files.
"""

import ctypes
import functools
import hashlib
import json
import logging
import os
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAGIC = b"CHATKV\x00\x01"
_LENGTH = struct.Struct("<I")
SUFFIX = ".kv"
USAGE_REFRESH_S = 5.0
READ_AHEAD_MAX = 8  # states read ahead and not yet taken (a request's session turned out resident, say)


@dataclass(frozen=True)
class StoredState:
    tokens: list[int]
    state: ctypes.Array
    writer: str  # the node that wrote it


@dataclass(frozen=True)
class DiskUsage:
    sessions: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class WriteRecord:
    """One file written: what it cost the writer thread."""

    bytes: int
    ms: float


class CorruptFile(ValueError):
    pass


def _well_formed(header: dict) -> bool:
    counts = all(isinstance(header.get(k), int) and header[k] >= 0 for k in ("n_tokens", "state_bytes", "crc32"))
    return counts and all(isinstance(header.get(k), str) for k in ("session", "writer"))


def _token_list(raw: bytes) -> list[int]:
    tokens = array("i")
    tokens.frombytes(raw)
    return tokens.tolist()


def model_digest(path: Path) -> str:
    """The model file's identity: a state computed with other weights must never be reused. Hashed once per
    process for a file of the same size and time (in-process engines, as in tests and benchmarks)."""
    stat = path.stat()
    return _file_sha256(path, stat.st_size, stat.st_mtime_ns)


@functools.cache
def _file_sha256(path: Path, size: int, mtime_ns: int) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def file_name(key: str) -> str:
    """The file that holds `key`'s state, in any node's disk tier directory."""
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + SUFFIX


class DiskTier:
    def __init__(self, root: Path, *, budget_bytes: int, fingerprint: dict[str, Any], writer: str) -> None:
        self.root = root
        self.budget_bytes = budget_bytes
        self.fingerprint = fingerprint
        self.writer = writer
        self.root.mkdir(parents=True, exist_ok=True)
        self.writes: deque[WriteRecord] = deque(maxlen=1000)
        self._usage = DiskUsage()
        self._usage_counted_at = 0.0
        self._pending: OrderedDict[str, tuple[list[int], ctypes.Array]] = OrderedDict()
        self._read_ahead: OrderedDict[str, StoredState] = OrderedDict()
        self._known: dict[str, str] = {}  # file name -> session, for the files this node wrote, read or checked
        self._writing = 0
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._thread.start()

    # Any thread -------------------------------------------------------------------

    def path_for(self, key: str) -> Path:
        return self.root / file_name(key)

    def sessions(self) -> list[str]:
        """The sessions with a file here, among those this node wrote, read or checked at its start."""
        with self._cond:
            return list(self._known.values())

    def _know(self, path: Path, key: str | None) -> None:
        with self._cond:
            if key is None:
                self._known.pop(path.name, None)
            else:
                self._known[path.name] = key

    def usage(self) -> DiskUsage:
        """Files and bytes in the directory, whichever node wrote them (counted again every few seconds)."""
        if time.monotonic() - self._usage_counted_at > USAGE_REFRESH_S:
            self._usage = _count(self._files())
        return self._usage

    def scan(self) -> DiskUsage:
        """Check every file's header (a node does this at start); delete those it cannot use."""
        for path in self.root.glob("*" + SUFFIX):
            try:
                with path.open("rb") as f:
                    self._know(path, self._read_header(f)["session"])
            except (OSError, CorruptFile) as exc:
                self._reject(path, exc)
        self._enforce_budget()
        return self._usage

    def put(self, key: str, tokens: list[int], state: ctypes.Array) -> None:
        """Write this state for `key` soon (a later put for the same key replaces one not yet written)."""
        with self._cond:
            self._pending[key] = (tokens, state)
            self._pending.move_to_end(key)
            self._cond.notify()

    def flush(self, timeout: float = 60) -> bool:
        """Wait until every state handed over is on disk; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._pending and not self._writing, timeout=timeout)

    def close(self) -> None:
        self.flush()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def prefetch(self, key: str) -> None:
        """Read `key`'s state now, on this thread, for the `load` that will follow shortly."""
        if (stored := self._read(key)) is not None:
            with self._cond:
                self._read_ahead[key] = stored
                while len(self._read_ahead) > READ_AHEAD_MAX:
                    self._read_ahead.popitem(last=False)

    def load(self, key: str) -> StoredState | None:
        """`key`'s stored state, checked whole (read ahead, or now); None if there is none or it is unusable
        (then deleted)."""
        with self._cond:
            stored = self._read_ahead.pop(key, None)
        return stored if stored is not None else self._read(key)

    def _read(self, key: str) -> StoredState | None:
        path = self.path_for(key)
        try:
            with path.open("rb") as f:
                header = self._read_header(f)
                if header["session"] != key:
                    raise CorruptFile(f"holds session {header['session']!r}, not {key!r}")
                n_tokens, state_bytes = header["n_tokens"], header["state_bytes"]
                if f.tell() + 4 * n_tokens + state_bytes != os.fstat(f.fileno()).st_size:
                    raise CorruptFile("the file's size is not what its header says")
                raw_tokens = f.read(4 * n_tokens)
                state = (ctypes.c_uint8 * state_bytes)()
                f.readinto(memoryview(state))
            if zlib.crc32(state, zlib.crc32(raw_tokens)) != header["crc32"]:
                raise CorruptFile("checksum mismatch")
            os.utime(path)  # recently used: the budget evicts it last
        except FileNotFoundError:
            self._know(path, None)
            return None
        except (OSError, CorruptFile) as exc:
            self._reject(path, exc)
            return None
        self._know(path, key)
        return StoredState(tokens=_token_list(raw_tokens), state=state, writer=header["writer"])

    def discard(self, key: str) -> None:
        """Delete `key`'s file, and any write of it still waiting."""
        with self._cond:
            self._pending.pop(key, None)
            self._read_ahead.pop(key, None)
        path = self.path_for(key)
        path.unlink(missing_ok=True)
        self._know(path, None)

    # Reading and checking ----------------------------------------------------------

    def _read_header(self, f) -> dict[str, Any]:
        if f.read(len(MAGIC)) != MAGIC:
            raise CorruptFile("not a session state file of this version")
        length = f.read(_LENGTH.size)
        if len(length) != _LENGTH.size:
            raise CorruptFile("the file ends in its header")
        try:
            header = json.loads(f.read(_LENGTH.unpack(length)[0]))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptFile("unreadable header") from exc
        if not isinstance(header, dict) or not _well_formed(header):
            raise CorruptFile("incomplete header")
        if header.get("fingerprint") != self.fingerprint:
            mismatched = sorted(
                k for k in self.fingerprint if (header.get("fingerprint") or {}).get(k) != self.fingerprint[k]
            )
            raise CorruptFile(f"computed for another {', '.join(mismatched) or 'setup'}")
        return header

    def _reject(self, path: Path, why: Exception) -> None:
        logger.warning("KV disk tier: ignoring and deleting %s: %s", path.name, why)
        path.unlink(missing_ok=True)
        self._know(path, None)

    # Writer thread --------------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending or self._closed)
                if not self._pending:
                    return
                key, (tokens, state) = self._pending.popitem(last=False)
                self._writing += 1
            try:
                self._write(key, tokens, state)
                self._enforce_budget()
            except OSError:
                logger.exception("KV disk tier: could not write the state of %s", key)
            finally:
                with self._cond:
                    self._writing -= 1
                    self._cond.notify_all()

    def _write(self, key: str, tokens: list[int], state: ctypes.Array) -> None:
        started = time.perf_counter()
        raw_tokens = array("i", tokens).tobytes()
        header = json.dumps(
            {
                "session": key,
                "writer": self.writer,
                "fingerprint": self.fingerprint,
                "n_tokens": len(tokens),
                "state_bytes": len(state),
                "crc32": zlib.crc32(state, zlib.crc32(raw_tokens)),
            }
        ).encode()
        path = self.path_for(key)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_native_id()}.tmp")
        with temporary.open("wb") as f:
            f.write(MAGIC)
            f.write(_LENGTH.pack(len(header)))
            f.write(header)
            f.write(raw_tokens)
            f.write(memoryview(state))
        os.replace(temporary, path)
        self._know(path, key)
        self.writes.append(WriteRecord(bytes=path.stat().st_size, ms=(time.perf_counter() - started) * 1000))

    def _files(self) -> list[tuple[float, int, str]]:
        """(last used, size, path) of every state file in the directory, least recently used first."""
        files = []
        with self._cond:
            gone = set(self._known)
        for entry in os.scandir(self.root):
            if entry.name.endswith(SUFFIX):
                try:
                    stat = entry.stat()
                except FileNotFoundError:  # another node deleted it meanwhile
                    continue
                files.append((stat.st_mtime, stat.st_size, entry.path))
                gone.discard(entry.name)
        with self._cond:  # deleted by another node, or by the budget
            for name in gone:
                self._known.pop(name, None)
        self._usage_counted_at = time.monotonic()
        return sorted(files)

    def _enforce_budget(self) -> None:
        """Delete the least recently used files until the directory fits the budget."""
        files = self._files()
        total = sum(size for _, size, _ in files)
        while files and total > self.budget_bytes:
            _, size, path = files.pop(0)
            Path(path).unlink(missing_ok=True)
            self._know(Path(path), None)
            total -= size
        self._usage = _count(files)


def _count(files: list[tuple[float, int, str]]) -> DiskUsage:
    return DiskUsage(sessions=len(files), bytes=sum(size for _, size, _ in files))
