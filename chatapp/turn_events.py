"""A reader of a turn's stream that always sees the turn end: it falls back on the database when the
stream loses the end (Redis restarted without persistence), and in quiet spells it has a turn whose node
is gone sent on or failed (`turns_reap`), so no reader waits on a node that will never answer."""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import redis
from asgiref.sync import sync_to_async
from django.db import connection

from chatapp import streams
from chatapp.models import Turn
from chatapp.turns.events import end_event
from chatapp.turns.recovery import turns_reap

RECONNECT_S = 1.0


async def follow_turn(
    turn: Turn, *, after: str = "0-0", block_ms: int = 15_000
) -> AsyncIterator[tuple[str, dict[str, Any] | None]]:
    """`streams.follow`, riding out a Redis restart (it reconnects and resumes), and ended from the
    database when the stream goes quiet on a finished turn: a reader never waits for an end event that
    was lost with a restart. (entry id, None) marks a quiet spell, for keep-alives."""
    while True:
        try:
            async for entry_id, event in streams.follow(turn.stream_name, after=after, block_ms=block_ms):
                after = entry_id
                if event is None and (finished := await sync_to_async(_finished)(turn.pk)):
                    yield entry_id, end_event(finished)
                    return
                yield entry_id, event
                if event is not None and event["type"] in {"done", "error"}:
                    return
        except redis.RedisError:
            if finished := await sync_to_async(_finished)(turn.pk):
                yield after, end_event(finished)
                return
            yield after, None
            await asyncio.sleep(RECONNECT_S)


def _finished(turn_id: int) -> Turn | None:
    """The turn if it has finished, after sending it on or failing it if its node is gone. The database
    connection is closed again: a reader waits on Redis, not holding one of Postgres's connections."""
    try:
        turns_reap(turn_id=turn_id)
        turn = Turn.objects.select_related("assistant_message").get(pk=turn_id)
        return turn if turn.is_finished else None
    finally:
        connection.close()
