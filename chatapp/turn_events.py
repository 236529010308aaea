"""A turn's end as an event, the same from the node's stream and from the database, and a reader that
falls back on the database when the stream loses the end (Redis restarted without persistence)."""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import redis
from asgiref.sync import sync_to_async

from chatapp import streams
from chatapp.models import Turn

RECONNECT_S = 1.0


def end_event(turn: Turn) -> dict[str, Any]:
    """The done or error event for a finished turn, from what is stored."""
    if turn.status == Turn.Status.FAILED:
        return {"type": "error", "error": turn.error, "code": "generation_failed"}
    reply = turn.assistant_message
    return {
        "type": "done",
        "status": turn.status,
        "finish_reason": turn.finish_reason,
        "usage": {
            "prompt_tokens": turn.prompt_tokens or 0,
            "completion_tokens": turn.completion_tokens or 0,
            "cached_tokens": turn.cached_tokens or 0,
        },
        "text": reply.content if reply else "",
        "message_id": reply.pk if reply else None,
    }


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
    turn = Turn.objects.select_related("assistant_message").get(pk=turn_id)
    return turn if turn.is_finished else None
