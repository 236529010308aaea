"""The API's own handler: `/v1/` skips the browser's middleware and its thread hops, and keeps the security
headers, the HTTPS redirect and the ALLOWED_HOSTS check. Both handlers lend each request a thread that later
requests reuse."""

import asyncio
import json
import threading
import urllib.error
import urllib.request

import pytest
from asgiref.sync import SyncToAsync
from django.core.handlers.asgi import ASGIHandler
from django.core.signals import request_started

from chatapp.api.handler import ApiHandler
from chatapp.request_threads import RequestThreads, ThreadReusingHandler


def call(app, path: str, *, method: str = "POST", scheme: str = "http", host: str = "127.0.0.1") -> tuple[dict, bytes]:
    """One request through an ASGI application, in this process: (response start message, body)."""
    return asyncio.run(call_async(app, path, method=method, scheme=scheme, host=host))


async def call_async(
    app, path: str, *, method: str = "POST", scheme: str = "http", host: str = "127.0.0.1"
) -> tuple[dict, bytes]:
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": scheme,
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", host.encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    messages: list[dict] = []
    received = asyncio.Event()

    async def receive() -> dict:
        if not received.is_set():
            received.set()
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client stays connected
        return {}

    async def send(message: dict) -> None:
        messages.append(message)

    await app(scope, receive, send)
    return messages[0], b"".join(m.get("body", b"") for m in messages[1:])


def headers_of(start: dict) -> dict[str, str]:
    return {name.decode().lower(): value.decode() for name, value in start["headers"]}


def test_an_api_request_makes_no_thread_hop_for_middleware(monkeypatch):
    hops = []
    original = SyncToAsync.__call__

    async def counting(self, *args, **kwargs):
        hops.append(getattr(self.func, "__qualname__", repr(self.func)))
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(SyncToAsync, "__call__", counting)
    start, _ = call(ASGIHandler(), "/v1/models")
    assert start["status"] == 405
    browser_hooks = [hop for hop in hops if "Middleware.process_" in hop]
    assert len(browser_hooks) >= 10  # the browser's middleware: a hop for each of its hooks
    hops.clear()
    start, body = call(ApiHandler(), "/v1/models")
    assert start["status"] == 405 and json.loads(body)["error"]["message"] == "Use GET."
    # Django's own are left: the request_started signal's receivers, logging a 4xx, closing the response.
    assert len(hops) <= 3 and not [hop for hop in hops if "Middleware" in hop], hops


def test_the_api_keeps_the_security_headers_and_redirect(settings):
    start, _ = call(ApiHandler(), "/v1/models")
    headers = headers_of(start)
    assert headers["x-content-type-options"] == "nosniff"
    assert headers["referrer-policy"] == "same-origin"
    assert "content-length" in headers
    settings.SECURE_SSL_REDIRECT = True
    settings.SECURE_HSTS_SECONDS = 3600
    start, _ = call(ApiHandler(), "/v1/models")
    assert start["status"] == 301 and headers_of(start)["location"] == "https://127.0.0.1/v1/models"
    start, _ = call(ApiHandler(), "/v1/models", scheme="https")
    assert start["status"] == 405 and headers_of(start)["strict-transport-security"] == "max-age=3600"


def test_the_api_refuses_a_host_not_allowed():
    start, _ = call(ApiHandler(), "/v1/models", host="evil.example")
    assert start["status"] == 400


@pytest.mark.django_db(transaction=True)
def test_the_served_application_routes_the_api_and_the_pages_apart(asgi_server):
    request = urllib.request.Request(f"{asgi_server}/v1/models", method="POST", data=b"")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    api = refused.value.headers
    assert refused.value.code == 405 and api["X-Content-Type-Options"] == "nosniff"
    assert api["Set-Cookie"] is None and api["Content-Security-Policy"] is None  # no browser middleware
    with urllib.request.urlopen(f"{asgi_server}/login/", timeout=10) as page:
        assert page.headers["Content-Security-Policy"] and "csrftoken" in page.headers["Set-Cookie"]


def request_threads(requests) -> list[threading.Thread]:
    """The threads that ran each request's sync work (Django's request_started receivers)."""
    threads: list[threading.Thread] = []

    def record(**kwargs) -> None:
        threads.append(threading.current_thread())

    request_started.connect(record)
    try:
        requests()
    finally:
        request_started.disconnect(record)
    return threads


@pytest.mark.parametrize("handler", [ApiHandler, ThreadReusingHandler])
def test_later_requests_reuse_a_request_thread(handler):
    app = handler()
    reused = request_threads(lambda: [call(app, "/v1/models") for _ in range(3)])
    assert len(reused) == 3 and len(set(reused)) == 1 and reused[0] is not threading.current_thread()
    stock = ASGIHandler()
    started = request_threads(lambda: [call(stock, "/v1/models") for _ in range(3)])
    assert len(set(started)) == 3  # Django's own handler starts (and joins) a thread for each request


def test_requests_in_flight_together_each_have_a_thread():
    app = ThreadReusingHandler()
    threads: list[threading.Thread] = []
    both = threading.Barrier(2, timeout=10)

    def meet(**kwargs) -> None:
        threads.append(threading.current_thread())
        both.wait()  # returns once the other request's thread is here too: never, were they one thread

    async def two() -> None:
        await asyncio.gather(*(call_async(app, "/v1/models") for _ in range(2)))

    request_started.connect(meet)
    try:
        asyncio.run(two())
    finally:
        request_started.disconnect(meet)
    assert len(set(threads)) == 2 and len(app.threads.idle) == 2


def test_idle_request_threads_beyond_the_kept_number_end():
    threads = RequestThreads(keep=1)
    lent = [threads.lend() for _ in range(3)]
    assert len({id(executor) for executor in lent}) == 3
    for executor in lent:
        executor.submit(lambda: None).result()
        threads.give_back(executor)
    assert threads.idle == [lent[0]]
    with pytest.raises(RuntimeError):  # shut down
        lent[2].submit(lambda: None)
    assert threads.lend() is lent[0]
