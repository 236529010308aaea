"""How many event streams the stack holds open at once: many browser readers on a few long replies, each
a connection of its own to the web process, while Postgres's connections are counted. A waiting stream
holds none (`turn_events.in_database`), so Postgres's default 100 do not cap the readers."""

import http.client
import json
import threading
import time
from dataclasses import dataclass, field

from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY
from django.contrib.auth.models import User
from django.contrib.sessions.backends.db import SessionStore
from django.db import connection

from chatapp.models import Turn


def session_cookie(user: User) -> str:
    """A signed-in browser session for `user`, as the login page would make it."""
    store = SessionStore()
    store[SESSION_KEY] = str(user.pk)
    store[BACKEND_SESSION_KEY] = settings.AUTHENTICATION_BACKENDS[0]
    store[HASH_SESSION_KEY] = user.get_session_auth_hash()
    store.create()
    return store.session_key or ""


@dataclass
class StreamCounts:
    open_now: int = 0
    open_peak: int = 0
    refused: list[str] = field(default_factory=list)
    texts: dict[int, list[str]] = field(default_factory=dict)  # reader index -> the text it read
    lock: threading.Lock = field(default_factory=threading.Lock)

    def opened(self) -> None:
        with self.lock:
            self.open_now += 1
            self.open_peak = max(self.open_peak, self.open_now)

    def closed(self) -> None:
        with self.lock:
            self.open_now -= 1


def read_stream(port: int, cookie: str, turn: Turn, index: int, counts: StreamCounts) -> None:
    """One browser tab following a turn's events to their end."""
    connection_ = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        path = f"/c/{turn.conversation_id}/turns/{turn.pk}/events/"
        connection_.request("GET", path, headers={"Cookie": f"sessionid={cookie}", "Accept": "text/event-stream"})
        response = connection_.getresponse()
        if response.status != 200:
            counts.refused.append(f"{response.status} {response.read()[:200]!r}")
            return
        counts.opened()
        text: list[str] = []
        try:
            for raw in response:
                line = raw.decode().rstrip("\n")
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event["type"] == "start":
                    text.clear()
                elif event["type"] == "token":
                    text.append(event["text"])
                elif event["type"] in {"done", "error"}:
                    break
        finally:
            counts.closed()
        counts.texts[index] = text
    except OSError as exc:
        counts.refused.append(str(exc))
    finally:
        connection_.close()


def postgres_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()")
        return cursor.fetchone()[0]


def hold_streams(*, port: int, user: User, turns: list[Turn], readers: int, wait_s: float = 300) -> dict:
    """Open `readers` event streams spread over `turns` at once, read each to its end, and check every
    reader's text against the stored reply. Postgres's connections are sampled meanwhile."""
    cookie = session_cookie(user)
    counts = StreamCounts()
    threads = [
        threading.Thread(target=read_stream, args=(port, cookie, turns[k % len(turns)], k, counts), daemon=True)
        for k in range(readers)
    ]
    peak_connections = 0
    started = time.monotonic()
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads) and time.monotonic() - started < wait_s:
        peak_connections = max(peak_connections, postgres_connections())
        time.sleep(0.2)
    stored = {t.pk: (t.assistant_message.content if t.assistant_message else "") for t in _reloaded(turns)}
    read = {k: "".join(text) for k, text in counts.texts.items()}
    complete = sum(bool(text) and text == stored[turns[k % len(turns)].pk] for k, text in read.items())
    differing = [
        f"read {len(text)} chars, stored {len(stored[turns[k % len(turns)].pk])}"
        for k, text in read.items()
        if text != stored[turns[k % len(turns)].pk]
    ]
    return {
        "open_streams_peak": counts.open_peak,
        "streams_complete": complete,
        "streams_refused_or_cut": readers - complete,
        "refusal_samples": counts.refused[:3],
        "not_read_to_the_end": readers - len(read),
        "differing_samples": differing[:3],
        "postgres_connections_peak": peak_connections,
        "postgres_max_connections": _max_connections(),
        "stream_turns": {status: sum(t.status == status for t in _reloaded(turns)) for status in Turn.Status},
    }


def _reloaded(turns: list[Turn]) -> list[Turn]:
    return list(Turn.objects.select_related("assistant_message").filter(pk__in=[t.pk for t in turns]))


def _max_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SHOW max_connections")
        return int(cursor.fetchone()[0])
