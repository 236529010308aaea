"""Token streams: one Redis stream `turn:<public id>` per turn, written by the node, read by the web."""

import json
from collections.abc import AsyncIterator
from functools import cache
from typing import Any

import redis
import redis.asyncio as aioredis
from django.conf import settings


@cache
def client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)


def stream_key(turn_key: str) -> str:
    return f"turn:{turn_key}"


def cancel_key(turn_key: str) -> str:
    return f"turn:{turn_key}:cancel"


def publish(turn_key: str, event: dict[str, Any]) -> None:
    key = stream_key(turn_key)
    pipe = client().pipeline()
    pipe.xadd(key, {"event": json.dumps(event)})
    pipe.expire(key, settings.CHAT_STREAM_TTL_SECONDS)
    pipe.execute()


def read_all(turn_key: str) -> list[dict[str, Any]]:
    entries: list[tuple[str, dict[str, str]]] = client().xrange(stream_key(turn_key))  # type: ignore[assignment]
    return [json.loads(fields["event"]) for _, fields in entries]


def text_so_far(turn_key: str) -> str:
    """The reply's text so far: tokens since the latest start (a turn sent again restarts its text)."""
    text: list[str] = []
    for event in read_all(turn_key):
        if event["type"] == "start":
            text.clear()
        elif event["type"] == "token":
            text.append(event["text"])
    return "".join(text)


def request_cancel(turn_key: str) -> None:
    client().set(cancel_key(turn_key), "1", ex=settings.CHAT_STREAM_TTL_SECONDS)


def cancel_requested(turn_key: str) -> bool:
    return bool(client().exists(cancel_key(turn_key)))


@cache
def async_client() -> "aioredis.Redis":
    return aioredis.Redis.from_url(settings.REDIS_URL, decode_responses=True)


async def follow(turn_key: str, *, after: str = "0-0", block_ms: int = 15_000) -> AsyncIterator[tuple[str, dict]]:
    """Yield (entry id, event) from the turn's stream as the node writes it, until its done or error event.

    `after` resumes after an entry id already seen, so a reconnecting reader loses and repeats nothing.
    """
    key = stream_key(turn_key)
    while True:
        batches: list[tuple[str, list[tuple[str, dict[str, str]]]]] = await async_client().xread(  # type: ignore[assignment]
            {key: after}, block=block_ms, count=256
        )
        for _, entries in batches or []:
            for entry_id, fields in entries:
                after = entry_id
                event = json.loads(fields["event"])
                yield entry_id, event
                if event["type"] in {"done", "error"}:
                    return


async def request_cancel_async(turn_key: str) -> None:
    await async_client().set(cancel_key(turn_key), "1", ex=settings.CHAT_STREAM_TTL_SECONDS)
