"""An ASGI wrapper that refuses a request body over the limit while it arrives, not after.

Django's ASGI handler reads the whole body before any view runs, so a view's own check comes after the
upload. This refuses at once on the Content-Length header, and stops reading a body sent without one
(chunked) as soon as it passes the limit. The answer is a 413 in OpenAI's error format.
"""

import json
from typing import Any

LIMIT_MESSAGE = "The request body is over the {mib} MiB limit."


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    def __init__(self, app: Any, *, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return await self._refuse(send)
        received = 0

        async def limited_receive() -> dict:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _TooLarge
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _TooLarge:
            await self._refuse(send)

    async def _refuse(self, send: Any) -> None:
        error = {
            "message": LIMIT_MESSAGE.format(mib=self.limit // 2**20),
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }
        body = json.dumps({"error": error}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        headers.append((b"connection", b"close"))
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
