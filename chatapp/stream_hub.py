"""One blocking Redis read per web process for every turn stream its readers follow.

A reader that ran its own `XREAD BLOCK` would hold a Redis connection for as long as it waits, and a few
hundred open event streams would exhaust the client's pool. Instead the hub runs one `XREAD BLOCK` over
every followed stream at once, and hands each entry to the readers of that stream through their own
queues. A reader that joins rewinds its stream's read position to where it wants to start (readers
already there skip what they have seen) and wakes the hub through a stream of the hub's own, so joining
costs no wait; readers that join before the hub reads again share one wake. When Redis fails, every
reader is told (and follows again through `streams.follow`).
"""

import asyncio
import json
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

import redis

from chatapp import streams

HUB_BLOCK_MS = 5_000
READ_COUNT = 256


class _Reader:
    def __init__(self, after: str) -> None:
        self.position = after
        self.queue: asyncio.Queue[tuple[str, dict[str, Any]] | Exception] = asyncio.Queue()


class StreamHub:
    def __init__(self) -> None:
        self.readers: dict[str, set[_Reader]] = {}
        self.positions: dict[str, str] = {}  # where the hub reads each stream from next
        self.wake_key = f"hub:{uuid.uuid4().hex}:wake"
        self.wake_position = "0-0"
        self.wake_sent = False  # since the hub last took the streams' positions: a join needs no other wake
        self.task: asyncio.Task | None = None

    async def follow(self, key: str, *, after: str, block_ms: int) -> AsyncIterator[tuple[str, dict[str, Any] | None]]:
        """Entries of stream `key` after `after`, as `streams.follow` yields them."""
        reader = _Reader(after)
        self.readers.setdefault(key, set()).add(reader)
        current = self.positions.get(key)
        if current is None or streams.entry_order(after) < streams.entry_order(current):
            self.positions[key] = after  # rewind: readers already further on skip what they have seen
        if self.task is None or self.task.done():
            self.task = asyncio.create_task(self._run())
        await self._wake()
        try:
            while True:
                try:
                    item = await asyncio.wait_for(reader.queue.get(), block_ms / 1000)
                except TimeoutError:
                    yield reader.position, None
                    continue
                if isinstance(item, Exception):
                    raise item
                yield item
                if item[1]["type"] in {"done", "error"}:
                    return
        finally:
            self._leave(key, reader)

    def _leave(self, key: str, reader: _Reader) -> None:
        followers = self.readers.get(key)
        if followers is not None:
            followers.discard(reader)
            if not followers:
                del self.readers[key]
                self.positions.pop(key, None)

    async def _wake(self) -> None:
        """Make the hub read again with the positions as they are now. A wake already sent, that the hub has
        not yet answered by taking the positions, does for this join too: 500 readers opening their streams
        at once cost one Redis call, not 500."""
        if self.wake_sent:
            return
        self.wake_sent = True
        client = streams.async_client()
        pipe = client.pipeline(transaction=False)
        pipe.xadd(self.wake_key, {"w": "1"}, maxlen=16, approximate=True)
        pipe.expire(self.wake_key, 3600)
        try:
            await pipe.execute()
        except BaseException:
            self.wake_sent = False  # not sent: the next join tries again
            raise

    async def _run(self) -> None:
        client = streams.async_client()
        try:
            while self.readers:
                self.wake_sent = False
                asked = dict(self.positions)
                wanted: dict[Any, Any] = asked | {self.wake_key: self.wake_position}
                batches: list = await client.xread(wanted, block=HUB_BLOCK_MS, count=READ_COUNT)  # type: ignore[assignment]
                for key, entries in batches or []:
                    if key == self.wake_key:
                        self.wake_position = entries[-1][0]
                        continue
                    if self.positions.get(key) == asked[key]:  # not rewound meanwhile by a reader joining
                        self.positions[key] = entries[-1][0]
                    self._deliver(key, asked[key], entries)
        except redis.RedisError as exc:
            for followers in self.readers.values():
                for reader in followers:
                    reader.queue.put_nowait(exc)
            self.readers.clear()
            self.positions.clear()

    def _deliver(self, key: str, read_from: str, entries: list[tuple[str, dict[str, str]]]) -> None:
        """Hand the entries read after `read_from` to the readers that have seen everything up to there; a
        reader still before it (it joined during the read, and rewound) gets them from the next read."""
        start = streams.entry_order(read_from)
        readers = [r for r in self.readers.get(key, ()) if streams.entry_order(r.position) >= start]
        for entry_id, fields in entries:
            event = json.loads(fields["event"])
            order = streams.entry_order(entry_id)
            for reader in readers:
                if order > streams.entry_order(reader.position):
                    reader.position = entry_id
                    reader.queue.put_nowait((entry_id, event))


_hubs: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, StreamHub]" = weakref.WeakKeyDictionary()


def hub() -> StreamHub:
    """The running event loop's hub (its Redis connections cannot cross loops)."""
    loop = asyncio.get_running_loop()
    if loop not in _hubs:
        _hubs[loop] = StreamHub()
    return _hubs[loop]
