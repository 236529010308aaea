"""The web process's one shared stream reader, on the real Redis: readers joining at any moment, from any
position, each get every entry after their position exactly once and in order, on one blocking read."""

import asyncio
import uuid

from chatapp import stream_hub, streams


async def _follow(hub: stream_hub.StreamHub, key: str, after: str) -> list[str]:
    texts = []
    async for _, event in hub.follow(streams.stream_key(key), after=after, block_ms=2000):
        if event is not None and event["type"] == "token":
            texts.append(event["text"])
    return texts


async def _scenario() -> tuple[list[str], list[list[str]], list[list[str]]]:
    key = f"hub-test-{uuid.uuid4().hex}"
    hub = stream_hub.StreamHub()
    sent = [f"t{k} " for k in range(300)]  # more than one read's worth (READ_COUNT)
    from_start: list[asyncio.Task] = []
    from_middle: list[asyncio.Task] = []
    middle = "0-0"
    for k, text in enumerate(sent):
        streams.publish(key, {"type": "token", "text": text}, attempt=0)
        if k % 50 == 0:  # readers join while the hub is reading: they rewind it
            from_start.append(asyncio.create_task(_follow(hub, key, "0-0")))
        if k == 149:
            middle = streams.snapshot(key)[1]
            from_middle.append(asyncio.create_task(_follow(hub, key, middle)))
        if k % 7 == 0:
            await asyncio.sleep(0.001)
    streams.publish(key, {"type": "done"}, attempt=0)
    starts = await asyncio.gather(*from_start)
    middles = await asyncio.gather(*from_middle)
    assert hub.readers == {}  # every reader left at its end
    return sent, starts, middles


def test_every_reader_gets_each_entry_once_in_order_whenever_it_joins():
    sent, starts, middles = asyncio.run(_scenario())
    assert len(starts) == 6 and all(texts == sent for texts in starts)
    assert middles == [sent[150:]]


async def _crowd(readers: int) -> tuple[list[str], list[list[str]], int]:
    """What was sent, what each of `readers` joining at once read, and how often they woke the hub."""
    key = f"hub-crowd-{uuid.uuid4().hex}"
    sent = [f"t{k} " for k in range(20)]
    for text in sent:
        streams.publish(key, {"type": "token", "text": text}, attempt=0)
    streams.publish(key, {"type": "done"}, attempt=0)
    hub = stream_hub.StreamHub()
    read = list(await asyncio.gather(*(_follow(hub, key, "0-0") for _ in range(readers))))
    return sent, read, streams.client().xlen(hub.wake_key)


def test_hundreds_of_readers_joining_at_once_all_read_their_stream():
    """Each joining reader wakes the hub with a Redis call: 500 at once are more than the event loop's client
    has connections (100), and the excess wait for one instead of failing ("Too many connections", which
    had sent late readers of a finished reply its end from Postgres without its text as tokens)."""
    sent, read, _ = asyncio.run(_crowd(500))
    assert len(read) == 500 and all(texts == sent for texts in read)


def test_readers_joining_together_share_one_wake():
    """The hub's wake stream keeps its last 16 entries or more (trimmed approximately): one wake each
    would leave at least 16."""
    sent, read, wakes = asyncio.run(_crowd(200))
    assert all(texts == sent for texts in read)
    assert wakes <= 2
