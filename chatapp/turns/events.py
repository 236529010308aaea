"""A turn's end as a stream event, built from what is stored: the same whether the node streamed it or a
reader rebuilt it from Postgres because the stream lost it."""

from typing import Any

from chatapp.models import Turn


def end_event(turn: Turn) -> dict[str, Any]:
    """The done or error event for a finished turn."""
    if turn.status == Turn.Status.FAILED:
        code = turn.error_code or "generation_failed"
        return {"type": "error", "error": turn.error, "code": code, "attempt": turn.attempt}
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
        "attempt": turn.attempt,
    }
