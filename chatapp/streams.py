"""Token streams: one Redis stream `turn:<public id>` per turn, written by the node, read by the web."""

import asyncio
import enum
import json
import logging
import re
import threading
import time
import weakref
from functools import cache
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings

logger = logging.getLogger(__name__)


_client: redis.Redis | None = None
_client_lock = threading.Lock()


def client() -> redis.Redis:
    """The process's one sync client, made once under a lock.

    Not `functools.cache`: threads that miss it together each make a client, and the ones not kept are
    garbage collected at once; `Redis.__del__` closes its own pool, connections in use included, under
    the command its thread is still sending (an AttributeError deep in redis-py, a 500 on a login).
    """
    global _client
    if _client is None:
        with _client_lock:
            if _client is None:
                _client = redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)
    return _client


def stream_key(turn_key: str) -> str:
    return f"turn:{turn_key}"


def cancel_key(turn_key: str) -> str:
    return f"turn:{turn_key}:cancel"


_ENTRY_ID = re.compile(r"^\d{1,20}-\d{1,20}$")


def valid_entry_id(entry_id: str) -> bool:
    return bool(_ENTRY_ID.match(entry_id))


def entry_order(entry_id: str) -> tuple[int, int]:
    """Stream entry ids ("<ms>-<seq>") in order; as strings "999-0" would sort after "1000-0"."""
    ms, seq = entry_id.split("-")
    return int(ms), int(seq)


def attempt_key(turn_key: str) -> str:
    """The turn's fencing token: the latest attempt allowed to write to its stream."""
    return f"turn:{turn_key}:attempt"


class Appended(enum.IntEnum):
    """What appending an event did; false only when nothing was written."""

    SUPERSEDED = 0  # a later attempt owns the stream: nothing written
    WRITTEN = 1
    STOP_ASKED = 2  # written, and the turn's reader has asked it to stop (`request_cancel`)


# Appends an event unless a later attempt owns the stream, and says whether a stop was asked, so that a
# node streaming tokens needs no read of its own for that (KEYS: stream, attempt, cancel; ARGV: event,
# attempt, ttl). Returns an `Appended`.
_PUBLISH = """
local current = tonumber(redis.call('GET', KEYS[2]) or '-1')
local attempt = tonumber(ARGV[2])
if attempt < current then return 0 end
if attempt > current then redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3]) end
redis.call('XADD', KEYS[1], '*', 'event', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return 1 + redis.call('EXISTS', KEYS[3])
"""
# Raises the fencing token to an attempt, never lowers it (KEYS: attempt; ARGV: attempt, ttl).
_FENCE = """
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > current then redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end
return 1
"""


@cache
def _scripts() -> tuple[Any, Any]:
    return client().register_script(_PUBLISH), client().register_script(_FENCE)


def publish_keys(turn_key: str) -> list[str]:
    """The keys the publish script reads and writes, in its order."""
    return [stream_key(turn_key), attempt_key(turn_key), cancel_key(turn_key)]


def publish_sha() -> str:
    """The publish script's SHA-1, for EVALSHA in a pipeline (`chatapp.stream_writer`)."""
    return _scripts()[0].sha


def load_scripts() -> None:
    """Load the scripts into a Redis that has forgotten them (it restarted): EVALSHA in a pipeline does not."""
    for script in _scripts():
        client().script_load(script.script)


def publish(turn_key: str, event: dict[str, Any], *, attempt: int) -> Appended:
    """Append the event, tagged with its attempt, to the turn's stream; SUPERSEDED (nothing written) when a
    later attempt of the turn owns the stream: a node that was replaced cannot write into its successor's."""
    event = event | {"attempt": attempt}
    ttl = settings.CHAT_STREAM_TTL_SECONDS
    return Appended(_scripts()[0](keys=publish_keys(turn_key), args=[json.dumps(event), attempt, ttl]))


def fence(turn_key: str, attempt: int) -> None:
    """From now on only `attempt` (or a later one) may write to the turn's stream."""
    _scripts()[1](keys=[attempt_key(turn_key)], args=[attempt, settings.CHAT_STREAM_TTL_SECONDS])


def publish_or_log(turn_key: str, event: dict[str, Any], *, attempt: int) -> Appended:
    """`publish`, but a Redis outage only loses the live event, not the turn: the node goes on and
    stores the reply in Postgres, where readers find it once the stream has nothing more for them.
    SUPERSEDED only when a later attempt owns the stream."""
    try:
        return publish(turn_key, event, attempt=attempt)
    except redis.RedisError as exc:
        level = logging.DEBUG if event.get("type") == "token" else logging.WARNING
        logger.log(level, "turn %s: %s event not streamed (%s)", turn_key, event.get("type"), exc)
        return Appended.WRITTEN


def read_all(turn_key: str) -> list[dict[str, Any]]:
    return [event for _, event in _entries(turn_key)]


def _entries(turn_key: str) -> list[tuple[str, dict[str, Any]]]:
    entries: list[tuple[str, dict[str, str]]] = client().xrange(stream_key(turn_key))  # type: ignore[assignment]
    return [(entry_id, json.loads(fields["event"])) for entry_id, fields in entries]


def snapshot(turn_key: str) -> tuple[str, str]:
    """The reply's text so far and the id of the last entry it includes, from one read, so that a reader
    showing this text and resuming after that id loses and repeats nothing. A turn sent again (its node
    died) restarts its text at its new start event."""
    text: list[str] = []
    last = "0-0"
    for entry_id, event in _entries(turn_key):
        last = entry_id
        if event["type"] == "start":
            text.clear()
        elif event["type"] == "token":
            text.append(event["text"])
    return "".join(text), last


def latest_attempt_start(turn_key: str) -> str:
    """The entry id to follow the turn's stream after, to see its latest attempt from its start (the id
    just before that attempt's start event; "0-0" when there is none yet)."""
    before, previous = "0-0", "0-0"
    for entry_id, event in _entries(turn_key):
        if event["type"] == "start":
            before = previous
        previous = entry_id
    return before


def text_so_far(turn_key: str) -> str:
    return snapshot(turn_key)[0]


def wait_finished(turn_key: str, *, timeout_s: float) -> tuple[float | None, dict[str, Any] | None]:
    """Block until the turn's done or error event: (perf_counter time its first token arrived, that event);
    the event is None if `timeout_s` passed first. For clients outside the web process (replays, load tests)."""
    key, after, first_token_at = stream_key(turn_key), "0-0", None
    deadline = time.monotonic() + timeout_s
    while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
        batches: list = client().xread({key: after}, block=min(left_ms, 1000), count=256)  # type: ignore[assignment]
        for _, entries in batches or []:
            for entry_id, fields in entries:
                after = entry_id
                event = json.loads(fields["event"])
                if event["type"] == "start":
                    first_token_at = None  # sent again: its text restarts
                elif event["type"] == "token" and first_token_at is None:
                    first_token_at = time.perf_counter()
                elif event["type"] in {"done", "error"}:
                    return first_token_at, event
    return first_token_at, None


def request_cancel(turn_key: str) -> None:
    client().set(cancel_key(turn_key), "1", ex=settings.CHAT_STREAM_TTL_SECONDS)


_async_clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aioredis.Redis]" = weakref.WeakKeyDictionary()


# The event loop's client opens at most this many connections; a call past them waits for one (up to
# ASYNC_POOL_WAIT_S) instead of failing. Hundreds of event streams opening at once each wake the stream hub
# and count themselves, and redis-py's own asyncio pool raised "Too many connections" past 100.
ASYNC_POOL_CONNECTIONS = 100
ASYNC_POOL_WAIT_S = 20


def async_client() -> "aioredis.Redis":
    """An asyncio Redis client for the running event loop (its connections cannot cross loops)."""
    loop = asyncio.get_running_loop()
    if loop not in _async_clients:
        pool = aioredis.BlockingConnectionPool.from_url(
            settings.REDIS_URL, decode_responses=True, max_connections=ASYNC_POOL_CONNECTIONS, timeout=ASYNC_POOL_WAIT_S
        )
        _async_clients[loop] = aioredis.Redis(connection_pool=pool)
    return _async_clients[loop]


async def request_cancel_async(turn_key: str) -> None:
    await async_client().set(cancel_key(turn_key), "1", ex=settings.CHAT_STREAM_TTL_SECONDS)
