"""`POST /v1/chat/completions` and `GET /v1/models`, shaped like OpenAI's API.

The views are async: a reply is read from the turn's Redis stream as the node
writes it, so a waiting request holds no thread. A streaming client that goes
away cancels its turn (the node keeps the session's cache).
"""

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from chatapp import streams
from chatapp.api.errors import ApiError
from chatapp.api.keys import api_key_find
from chatapp.api.parsing import ChatRequest, parse_chat_request
from chatapp.api.sessions import api_turn_start
from chatapp.metrics import counted_stream
from chatapp.models import ApiKey, Turn
from chatapp.turn_events import follow_turn, in_database
from chatapp.turns.lifecycle import turn_cancel
from router.services import ServedModel, served_models

FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}
RESTARTED = ApiError(
    "The node writing this reply stopped, and the reply was started again on another node. The text sent so far "
    "is void; send the same request again to receive the whole reply.",
    status=503,
    type="server_error",
    code="reply_restarted",
)


def _authenticate(request: HttpRequest) -> ApiKey:
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    row = api_key_find(key.strip()) if scheme.lower() == "bearer" else None
    if row is None:
        raise ApiError(
            "Incorrect or missing API key. Send 'Authorization: Bearer <key>'; keys are made at /keys/.",
            status=401,
            type="authentication_error",
            code="invalid_api_key",
        )
    return row


def _start(request: HttpRequest, parsed: ChatRequest) -> Turn:
    """Authenticate and start the turn: one hop to a thread for both."""
    return api_turn_start(
        key=_authenticate(request),
        request=parsed,
        session_id=request.headers.get("X-Session-ID"),
        strategy=request.headers.get("X-Memory-Strategy"),
    )


def _served(request: HttpRequest) -> dict[str, ServedModel]:
    """Authenticate, then the models served: one hop to a thread for both."""
    _authenticate(request)
    return served_models()


@csrf_exempt
async def models(request: HttpRequest) -> HttpResponse:
    """The models some live node serves (a model whose nodes are all down is not offered)."""
    try:
        if request.method != "GET":
            raise ApiError("Use GET.", status=405)
        served = await in_database(_served, request)
    except ApiError as exc:
        return exc.response()
    data = [
        {"id": m.model, "object": "model", "created": 0, "owned_by": "chatapp", "max_model_len": m.n_ctx}
        for m in sorted(served.values(), key=lambda m: m.model)
    ]
    return JsonResponse({"object": "list", "data": data})


@csrf_exempt
async def chat_completions(request: HttpRequest) -> HttpResponse | StreamingHttpResponse:
    try:
        if request.method != "POST":
            raise ApiError("Use POST.", status=405)
        parsed = parse_chat_request(_body(request))
        turn = await in_database(_start, request, parsed)
        if parsed.stream:
            response = StreamingHttpResponse(
                counted_stream("api", _chunks(turn, parsed)), content_type="text/event-stream"
            )
            response["Cache-Control"] = "no-cache"
            response["X-Accel-Buffering"] = "no"
            response["X-Session-ID"] = request.headers.get("X-Session-ID", "")
            return response
        return JsonResponse(await _completion(turn, parsed))
    except ApiError as exc:
        return exc.response()


def _body(request: HttpRequest) -> bytes:
    try:
        return request.body
    except RequestDataTooBig as exc:
        limit = settings.DATA_UPLOAD_MAX_MEMORY_SIZE // 2**20
        message = f"The request body is over the {limit} MiB limit."
        raise ApiError(message, status=413, code="request_too_large") from exc


def _completion_id(turn: Turn) -> str:
    return f"chatcmpl-{turn.public_id.hex}"


def _usage(done: dict) -> dict:
    usage = done["usage"]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "total_tokens": usage["prompt_tokens"] + usage["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": usage["cached_tokens"]},
    }


def _failure(event: dict) -> ApiError:
    if event.get("code") == "context_length_exceeded":
        return ApiError(event["error"], param="messages", code="context_length_exceeded")
    if event.get("code") == "no_node":
        return ApiError(event["error"], status=503, type="server_error", code="no_node")
    return ApiError(f"The model failed: {event['error']}", status=500, type="server_error", code=event.get("code"))


async def _events(turn: Turn, after: str = "0-0") -> AsyncIterator[dict]:
    """The turn's events; past CHAT_API_TIMEOUT_SECONDS the turn is cancelled and an ApiError (504) raised."""
    limit = settings.CHAT_API_TIMEOUT_SECONDS
    try:
        async with asyncio.timeout(limit):
            async for _, event in follow_turn(turn, after=after, block_ms=settings.CHAT_SSE_BLOCK_MS):
                if event is not None:
                    yield event
    except TimeoutError:
        await in_database(turn_cancel, turn=turn)
        raise ApiError(
            f"The reply took longer than {limit} s and was cancelled.", status=504, type="server_error", code="timeout"
        ) from None


async def _completion(turn: Turn, parsed: ChatRequest) -> dict:
    async for event in _events(turn):
        if event["type"] == "error":
            raise _failure(event)
        if event["type"] == "done":
            return {
                "id": _completion_id(turn),
                "object": "chat.completion",
                "created": int(time.time()),
                "model": parsed.model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": event["text"]},
                        "finish_reason": FINISH_REASONS[event["finish_reason"]],
                        "logprobs": None,
                    }
                ],
                "usage": _usage(event),
            }
    raise ApiError("The reply did not finish.", status=500, type="server_error")


async def _chunks(turn: Turn, parsed: ChatRequest) -> AsyncGenerator[str]:
    base = {
        "id": _completion_id(turn),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": parsed.model,
    }

    def chunk(delta: dict, finish: str | None = None, **extra) -> str:
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
        return f"data: {json.dumps(base | {'choices': choices} | extra)}\n\n"

    # A turn sent again (its node died) restarts its text. Until this stream has sent text, the new
    # attempt simply carries on; after, the client cannot take text back, so the stream ends with an
    # error (code "reply_restarted") instead of repeating text. The turn goes on: the same request sent
    # again gets its reply whole (`api_turn_start`), from the latest attempt's start.
    finished = sent_text = False
    first_attempt: int | None = None
    try:
        yield chunk({"role": "assistant", "content": ""})
        # A first attempt's stream starts with it: no read of the stream is needed to find where.
        after = "0-0" if turn.attempt == 0 else streams.latest_attempt_start(turn.stream_name)
        async for event in _events(turn, after=after):
            if event["type"] == "start":
                first_attempt = event["attempt"] if first_attempt is None else first_attempt
                if sent_text and event["attempt"] != first_attempt:
                    finished = True
                    yield f"data: {json.dumps({'error': RESTARTED.response_body()})}\n\n"
                    break
            elif event["type"] == "token":
                sent_text = True
                yield chunk({"content": event["text"]})
            elif event["type"] == "error":
                finished = True
                yield f"data: {json.dumps({'error': _failure(event).response_body()})}\n\n"
            elif event["type"] == "done":
                finished = True
                if not sent_text and event["text"]:  # the stream lost its tokens: the stored reply, whole
                    yield chunk({"content": event["text"]})
                yield chunk({}, FINISH_REASONS[event["finish_reason"]])
                if parsed.include_usage:
                    yield f"data: {json.dumps(base | {'choices': [], 'usage': _usage(event)})}\n\n"
    except ApiError as exc:  # the timeout: the turn is already cancelled
        finished = True
        yield f"data: {json.dumps({'error': exc.response_body()})}\n\n"
    finally:
        if not finished:  # the client went away: stop generating
            await in_database(turn_cancel, turn=turn)
    yield "data: [DONE]\n\n"
