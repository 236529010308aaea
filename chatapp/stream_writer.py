"""A node's token appends, every running turn's together: one thread sends whatever has queued up as one
pipelined Redis round trip.

Each engine step gives every running reply a token at about the same moment. Appended one by one, from
the reply's own task thread, that was one round trip (and a wake-up of Redis and of the web's stream
reader) per token, each taking a core from the compute threads mid-step. Batched, a step's tokens cost one
of each. Appends keep their order (one queue, one writer); each answers, when its batch comes back, what
`streams.publish` answers: written, a stop asked, or a later attempt owning the stream.
"""

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import redis
from django.conf import settings

from chatapp import streams

logger = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 10


@dataclass
class Appends:
    """One turn attempt's appends: what the latest answered one said, and how many are still queued."""

    turn_key: str
    attempt: int
    answer: streams.Appended | None = None
    answered_at: float = 0.0  # time.monotonic() of the answer
    queued: int = 0
    _done: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def wait_written(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Until every append queued so far has been sent (or given up on); False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self.queued == 0, timeout)


class StreamWriter:
    def __init__(self) -> None:
        self._queue: deque[tuple[Appends, str]] = deque()
        self._ready = threading.Condition()
        self._thread: threading.Thread | None = None

    def append(self, appends: Appends, event: dict[str, Any]) -> None:
        """Queue the event for the turn's stream; it is sent with whatever else is queued by then."""
        body = json.dumps(event | {"attempt": appends.attempt})
        with appends._done:
            appends.queued += 1
        with self._ready:
            self._queue.append((appends, body))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-writer", daemon=True)
                self._thread.start()
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                self._ready.wait_for(lambda: bool(self._queue))
                batch = [self._queue.popleft() for _ in range(len(self._queue))]
            try:
                answers = self._send(batch)
            except Exception:  # the writer must outlive a bad batch, or every later turn waits on it
                logger.exception("%d token events not streamed", len(batch))
                answers = [streams.Appended.WRITTEN] * len(batch)
            for (appends, _), answer in zip(batch, answers, strict=True):
                with appends._done:
                    appends.answer, appends.queued = answer, appends.queued - 1
                    appends.answered_at = time.monotonic()
                    appends._done.notify_all()

    def _send(self, batch: list[tuple[Appends, str]]) -> list[streams.Appended]:
        """The batch's appends in one round trip. A Redis outage loses the live text, never the reply (the
        node stores it in Postgres), as `streams.publish_or_log` does: the appends then count as written."""
        try:
            try:
                return self._pipelined(batch)
            except redis.exceptions.NoScriptError:  # Redis restarted and forgot the script
                streams.load_scripts()
                return self._pipelined(batch)
        except redis.RedisError as exc:
            logger.debug("%d token events not streamed (%s)", len(batch), exc)
            return [streams.Appended.WRITTEN] * len(batch)

    @staticmethod
    def _pipelined(batch: list[tuple[Appends, str]]) -> list[streams.Appended]:
        ttl = settings.CHAT_STREAM_TTL_SECONDS
        pipe = streams.client().pipeline(transaction=False)
        for appends, body in batch:
            keys = streams.publish_keys(appends.turn_key)
            pipe.evalsha(streams.publish_sha(), len(keys), *keys, body, appends.attempt, ttl)
        return [streams.Appended(code) for code in pipe.execute()]


_writer = StreamWriter()


def writer() -> StreamWriter:
    """The process's one writer (its thread starts with the first append)."""
    return _writer
