"""The client side of a streamed OpenAI chat completion, for the load test and bench_stack."""

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class StreamedReply:
    text: str = ""
    ttft_ms: float | None = None  # from `started` to the first piece of text
    usage: dict = field(default_factory=dict)  # the usage chunk, when the request asked for one
    error: dict | None = None  # the stream's error object, if it sent one


def read_chat_stream(lines: Iterable[bytes], started: float) -> StreamedReply:
    """Read a `text/event-stream` of chat completion chunks to its end (`started`: time.perf_counter()
    when the request was sent)."""
    reply = StreamedReply()
    pieces: list[str] = []
    for raw in lines:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        data = json.loads(line[6:])
        if "error" in data:
            reply.error = data["error"]
        for choice in data.get("choices") or []:
            if piece := (choice.get("delta") or {}).get("content"):
                reply.ttft_ms = reply.ttft_ms or (time.perf_counter() - started) * 1000
                pieces.append(piece)
        reply.usage = data.get("usage") or reply.usage
    reply.text = "".join(pieces)
    return reply
