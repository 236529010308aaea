"""A node's token appends, every running turn's together: one thread sends whatever has queued up as one
pipelined Redis round trip, at most once every CHAT_STREAM_INTERVAL_MS.

Each engine step gives every running reply a token at about the same moment. Appended one by one, from
the reply's own task thread, that was one round trip (and a wake-up of Redis and of the web's stream
reader) per token, each taking a core from the compute threads mid-step. Batched, a step's tokens cost one
of each. Paced, the tokens of the steps within an interval go as one entry per reply (their texts joined),
so Redis, the web's stream reader and each response handle one entry, and wake once, for several tokens:
vLLM's `stream_interval`, in time rather than tokens, so that a reader sees text as often on any hardware.
A reply's first text, and a flush its task waits on (its end), go at once: neither a first token nor a
reply's end waits for the interval.

Appends keep their order (one queue, one writer); each answers, when its batch comes back, what
`streams.publish` answers: written, a stop asked, or a later attempt owning the stream.

It also tells the engine when an attempt must end (`Appends.stopped`, an event the engine reads every
step): from an append's answer while text flows, and for the attempts it watches that have no append in
flight, from its own read of their cancel flags, all in one round trip with whatever text goes then: one
waiting for its first token (its prompt is still being computed) every STOP_CHECK_S, one paused beside a
long step every PAUSE_CHECK_S. Before, each waiting task thread woke every 0.1 s and read its own flag
until its first token: a timed wait and a round trip per turn per tenth of a second, beside llama.cpp.
"""

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import redis
from django.conf import settings

from chatapp import streams

logger = logging.getLogger(__name__)
FLUSH_TIMEOUT_S = 10
# How stale a watched attempt's last word from Redis may get before its cancel flag is read: before its
# first append, and once it has appended (its appends answer every interval while text flows; only a pause
# beside a long step outlasts this).
STOP_CHECK_S = 0.1
PAUSE_CHECK_S = 0.5


@dataclass(eq=False)
class Appends:
    """One turn attempt's appends: what the latest answered one said, and how many are still queued."""

    turn_key: str
    attempt: int
    answer: streams.Appended | None = None
    answered_at: float = 0.0  # time.monotonic() of the latest answer, or of the latest read of its flag
    stopped: threading.Event = field(default_factory=threading.Event)  # set once the attempt must end
    queued: int = 0
    _done: threading.Condition = field(default_factory=threading.Condition, repr=False)

    def wait_written(self, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Until every append queued so far has been sent (or given up on); False on timeout."""
        with self._done:
            return self._done.wait_for(lambda: self.queued == 0, timeout)

    def check_due(self) -> float:
        """When its cancel flag is next to be read, if it is watched (time.monotonic())."""
        return self.answered_at + (STOP_CHECK_S if self.answer is None else PAUSE_CHECK_S)


@dataclass
class _Entry:
    """What one batch sends for one attempt: its queued texts, joined into one token event."""

    appends: Appends
    texts: list[str] = field(default_factory=list)

    def body(self) -> str:
        return json.dumps({"type": "token", "text": "".join(self.texts), "attempt": self.appends.attempt})


class StreamWriter:
    def __init__(self, interval_s: float | None = None) -> None:
        self.interval_s = settings.CHAT_STREAM_INTERVAL_MS / 1000 if interval_s is None else interval_s
        self._queue: deque[tuple[Appends, str]] = deque()
        self._ready = threading.Condition()
        self._urgent = False  # send without waiting out the interval
        self._sent_at = 0.0
        self._watched: set[Appends] = set()
        self._thread: threading.Thread | None = None

    def append(self, appends: Appends, text: str) -> None:
        """Queue text for the turn's stream; it is sent with whatever else is queued by then, at once if it
        is the attempt's first."""
        with appends._done:
            first = appends.answer is None and appends.queued == 0
            appends.queued += 1
        with self._ready:
            self._queue.append((appends, text))
            self._urgent = self._urgent or first
            self._start()
            self._ready.notify()

    def watch(self, appends: Appends) -> None:
        """Set `appends.stopped` once its turn's reader asks it to stop, until `unwatch`: its cancel flag is
        read at once, then whenever nothing from Redis has answered for the attempt in STOP_CHECK_S
        (PAUSE_CHECK_S once it has text). An append's answer that says stop sets it too."""
        with self._ready:
            appends.answered_at = 0.0
            self._watched.add(appends)
            self._start()
            self._ready.notify()

    def unwatch(self, appends: Appends) -> None:
        with self._ready:
            self._watched.discard(appends)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="stream-writer", daemon=True)
            self._thread.start()

    def flush(self, appends: Appends, timeout: float = FLUSH_TIMEOUT_S) -> bool:
        """Send what is queued now, and wait until the attempt's appends are all answered; False on timeout.
        An attempt with nothing queued hurries no one else's text."""
        if appends.queued:
            with self._ready:
                self._urgent = True
                self._ready.notify()
        return appends.wait_written(timeout)

    def _run(self) -> None:
        while True:
            with self._ready:
                batch, checked = self._next()
            self._sent_at = time.monotonic()
            entries: dict[Appends, _Entry] = {}
            for appends, text in batch:
                entries.setdefault(appends, _Entry(appends)).texts.append(text)
            checked = [appends for appends in checked if appends not in entries]  # its append answers it
            try:
                answers, stops = self._send(list(entries.values()), checked)
            except Exception:  # the writer must outlive a bad batch, or every later turn waits on it
                logger.exception("%d token events not streamed", len(batch))
                answers, stops = [streams.Appended.WRITTEN] * len(entries), [False] * len(checked)
            now = time.monotonic()
            for entry, answer in zip(entries.values(), answers, strict=True):
                appends = entry.appends
                with appends._done:
                    appends.answer, appends.queued = answer, appends.queued - len(entry.texts)
                    appends.answered_at = now
                    appends._done.notify_all()
                if answer in (streams.Appended.STOP_ASKED, streams.Appended.SUPERSEDED):
                    appends.stopped.set()
            for appends, stop in zip(checked, stops, strict=True):
                appends.answered_at = now
                if stop:
                    appends.stopped.set()

    def _next(self) -> tuple[list[tuple[Appends, str]], list[Appends]]:
        """Under `_ready`: wait until there is text to send (and its interval is out, unless it is urgent) or
        a watched attempt's flag is due; then take the queued text and the watched attempts due by then or
        soon after (so that attempts that started apart share their reads, not one trip each)."""
        while not self._queue:
            wake = min((appends.check_due() for appends in self._watched), default=None)
            if wake is not None and wake <= time.monotonic():
                break
            self._ready.wait(None if wake is None else wake - time.monotonic())
        if self._queue and (wait := self._sent_at + self.interval_s - time.monotonic()) > 0:
            self._ready.wait_for(lambda: self._urgent, wait)
        self._urgent = False
        batch = [self._queue.popleft() for _ in range(len(self._queue))]
        soon = time.monotonic() + STOP_CHECK_S / 2  # those due before the next check come now, in the same trip
        return batch, [appends for appends in self._watched if appends.check_due() <= soon]

    def _send(self, entries: list[_Entry], checked: list[Appends]) -> tuple[list[streams.Appended], list[bool]]:
        """The entries, and the cancel flags of `checked`, in one round trip. A Redis outage loses the live
        text, never the reply (the node stores it in Postgres), as `streams.publish_or_log` does: the appends
        then count as written, and no stop as asked (the turn goes on)."""
        try:
            try:
                return self._pipelined(entries, checked)
            except redis.exceptions.NoScriptError:  # Redis restarted and forgot the script
                streams.load_scripts()
                return self._pipelined(entries, checked)
        except redis.RedisError as exc:
            logger.debug("%d token events not streamed (%s)", len(entries), exc)
            return [streams.Appended.WRITTEN] * len(entries), [False] * len(checked)

    @staticmethod
    def _pipelined(entries: list[_Entry], checked: list[Appends]) -> tuple[list[streams.Appended], list[bool]]:
        ttl = settings.CHAT_STREAM_TTL_SECONDS
        pipe = streams.client().pipeline(transaction=False)
        for entry in entries:
            keys = streams.publish_keys(entry.appends.turn_key)
            pipe.evalsha(streams.publish_sha(), len(keys), *keys, entry.body(), entry.appends.attempt, ttl)
        for appends in checked:
            pipe.exists(streams.cancel_key(appends.turn_key))
        replies = pipe.execute()
        answers = [streams.Appended(code) for code in replies[: len(entries)]]
        return answers, [bool(found) for found in replies[len(entries) :]]


_writer: StreamWriter | None = None
_writer_lock = threading.Lock()


def writer() -> StreamWriter:
    """The process's one writer (made at its first use, once settings are read; its thread starts with the
    first append)."""
    global _writer
    if _writer is None:
        with _writer_lock:
            if _writer is None:
                _writer = StreamWriter()
    return _writer
