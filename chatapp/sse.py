"""Server-Sent Events for the browser: a turn's Redis stream, resumable by entry id."""

import json
from collections.abc import AsyncGenerator

import redis
from django.conf import settings
from django.http import Http404, HttpRequest, HttpResponse, StreamingHttpResponse

from chatapp import selectors, streams
from chatapp.metrics import counted_stream
from chatapp.models import Turn
from chatapp.turn_events import follow_turn, in_database

KEEPALIVE = ": keep-alive\n\n"


async def turn_events(request: HttpRequest, conversation_id: int, turn_id: int) -> HttpResponse | StreamingHttpResponse:
    """The turn's events as SSE. A reconnect (Last-Event-ID) or `?after=` resumes after that entry."""
    turn = await in_database(_readable_turn, request, conversation_id, turn_id)
    after = request.headers.get("Last-Event-ID") or request.GET.get("after") or "0-0"
    if not streams.valid_entry_id(after):
        return HttpResponse("after must be a stream entry id", status=400)
    try:
        last = streams.snapshot(turn.stream_name)[1]
    except redis.RedisError:
        # The page shows the stored state instead (chat.js); the reply is still written and kept.
        return HttpResponse("Live updates are unavailable for a moment.", status=503, headers={"Retry-After": "2"})
    if turn.is_finished and streams.entry_order(last) <= streams.entry_order(after):
        return HttpResponse(status=204)  # nothing more will come: tells EventSource to stop reconnecting
    response = StreamingHttpResponse(counted_stream("browser", _events(turn, after)), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response


def _readable_turn(request: HttpRequest, conversation_id: int, turn_id: int) -> Turn:
    """The turn, if the signed-in user may read it; else Http404."""
    if not request.user.is_authenticated:
        raise Http404
    return selectors.turn_get_for_user(user=request.user, conversation_id=conversation_id, turn_id=turn_id)


async def _events(turn: Turn, after: str) -> AsyncGenerator[str]:
    yield f"retry: 1000\n{KEEPALIVE}"
    async for entry_id, event in follow_turn(turn, after=after, block_ms=settings.CHAT_SSE_BLOCK_MS):
        if event is None:
            yield KEEPALIVE  # keeps proxies with idle timeouts from cutting a quiet stream
        else:
            yield f"id: {entry_id}\nevent: {event['type']}\ndata: {json.dumps(event)}\n\n"
