"""Token streams: one Redis stream `turn:<id>` per turn, written by the node, read by the web."""

import json
from functools import cache
from typing import Any

import redis
from django.conf import settings


@cache
def client() -> redis.Redis:
    return redis.Redis.from_url(settings.REDIS_URL, decode_responses=True)


def stream_key(turn_id: int) -> str:
    return f"turn:{turn_id}"


def cancel_key(turn_id: int) -> str:
    return f"turn:{turn_id}:cancel"


def publish(turn_id: int, event: dict[str, Any]) -> None:
    key = stream_key(turn_id)
    pipe = client().pipeline()
    pipe.xadd(key, {"event": json.dumps(event)})
    pipe.expire(key, settings.CHAT_STREAM_TTL_SECONDS)
    pipe.execute()


def read_all(turn_id: int) -> list[dict[str, Any]]:
    entries: list[tuple[str, dict[str, str]]] = client().xrange(stream_key(turn_id))  # type: ignore[assignment]
    return [json.loads(fields["event"]) for _, fields in entries]


def text_so_far(turn_id: int) -> str:
    return "".join(e["text"] for e in read_all(turn_id) if e["type"] == "token")


def request_cancel(turn_id: int) -> None:
    client().set(cancel_key(turn_id), "1", ex=settings.CHAT_STREAM_TTL_SECONDS)


def cancel_requested(turn_id: int) -> bool:
    return bool(client().exists(cancel_key(turn_id)))
