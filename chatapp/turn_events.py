"""A reader of a turn's stream that always sees the turn end: it falls back on the database when the
stream loses the end (Redis restarted without persistence), and in quiet spells it has a turn whose node
is gone sent on or failed (`turns_reap`), so no reader waits on a node that will never answer."""

import asyncio
import logging
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connection

from chatapp import stream_hub, streams
from chatapp.models import Turn
from chatapp.turns.events import end_event
from chatapp.turns.recovery import turns_reap

RECONNECT_S = 1.0
logger = logging.getLogger(__name__)


async def follow_turn(
    turn: Turn, *, after: str = "0-0", block_ms: int = 15_000
) -> AsyncIterator[tuple[str, dict[str, Any] | None]]:
    """(entry id, event) from the turn's stream after `after` as the node writes it, until its done or error
    event, through the web process's one shared reader (`stream_hub`). It rides out a Redis restart (it
    reconnects and resumes after the last entry seen), and is ended from the database when the stream goes
    quiet on a finished turn: a reader never waits for an end event lost with a restart. (entry id, None)
    marks a quiet spell of `block_ms`, for keep-alives."""
    while True:
        try:
            key = streams.stream_key(turn.stream_name)
            async for entry_id, event in stream_hub.hub().follow(key, after=after, block_ms=block_ms):
                after = entry_id
                if event is None and (finished := await _finished(turn.pk)):
                    yield entry_id, end_event(finished)
                    return
                yield entry_id, event
                if event is not None and event["type"] in {"done", "error"}:
                    return
        except redis.RedisError as exc:
            logger.warning("turn %s: reading its stream failed (%s); looking in Postgres", turn.pk, exc)
            if finished := await _finished(turn.pk):
                yield after, end_event(finished)
                return
            yield after, None
            await asyncio.sleep(RECONNECT_S)


_slots: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore]" = weakref.WeakKeyDictionary()


async def in_database[T](work: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    """`work(*args, **kwargs)` on a thread, holding one of CHAT_STREAM_DB_SLOTS turns at the database per
    web process, and then the thread's connection closed (given back to the pool), in the same hop. A
    stream waiting on Redis then holds no connection, and hundreds opening at once take turns instead of
    taking all of Postgres's connections."""
    loop = asyncio.get_running_loop()
    if loop not in _slots:
        _slots[loop] = asyncio.Semaphore(settings.CHAT_STREAM_DB_SLOTS)
    async with _slots[loop]:
        return await sync_to_async(_then_close)(work, args, kwargs)


def _then_close[T](work: Callable[..., T], args: tuple, kwargs: dict) -> T:
    """Run `work`, then close this thread's connection, unless it is inside a transaction: a test's, whose
    client runs the view in-process."""
    try:
        return work(*args, **kwargs)
    finally:
        if not connection.in_atomic_block:
            connection.close()


async def _finished(turn_id: int) -> Turn | None:
    return await in_database(_finished_now, turn_id)


def _finished_now(turn_id: int) -> Turn | None:
    """The turn if it has finished, after sending it on or failing it if its node is gone."""
    turns_reap(turn_id=turn_id)
    turn = Turn.objects.select_related("assistant_message").get(pk=turn_id)
    return turn if turn.is_finished else None
