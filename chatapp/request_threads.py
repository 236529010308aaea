"""Request threads, reused: each HTTP request still runs its sync work (the ORM, Django's signals) on a
thread of its own, but that thread outlives the request and serves a later one.

Django's `ASGIHandler` opens an asgiref `ThreadSensitiveContext` for each request. Given no executor, the
context starts a thread at the request's first sync call, and at the request's end starts a second
thread to join the first. Each start blocks the event loop until the new thread runs (`Thread.start`
waits for it), and on a node's machine llama.cpp's threads keep every core busy, so the loop, and every
stream it serves, waits for a core twice a request. A lent executor is not shut down by the context
(asgiref: "the caller owns the executor").
"""

import itertools
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import ThreadSensitiveContext
from django.core.handlers.asgi import ASGIHandler

# Idle threads kept for the next requests; more in flight at once each get a new one, ended afterwards.
KEEP_IDLE = 32


class RequestThreads:
    """Single-thread executors lent to requests, one per request in flight. Used from the event loop only."""

    def __init__(self, keep: int = KEEP_IDLE) -> None:
        self.idle: list[ThreadPoolExecutor] = []
        self.keep = keep
        self._made = itertools.count()

    def lend(self) -> ThreadPoolExecutor:
        if self.idle:
            return self.idle.pop()
        return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"request-{next(self._made)}")

    def give_back(self, executor: ThreadPoolExecutor) -> None:
        """Keep it for a later request. Work a cancelled request left running on it finishes first."""
        if len(self.idle) < self.keep:
            self.idle.append(executor)
        else:
            executor.shutdown(wait=False)


class ThreadReusingHandler(ASGIHandler):
    """Django's ASGI handler, each request's thread-sensitive work on a thread lent from `threads`."""

    def __init__(self) -> None:
        super().__init__()
        self.threads = RequestThreads()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        executor = self.threads.lend()
        try:
            async with ThreadSensitiveContext(executor=executor):
                await self.handle(scope, receive, send)
        finally:
            self.threads.give_back(executor)
