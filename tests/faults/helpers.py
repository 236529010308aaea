"""Real parts the fault tests break on purpose: a Redis of their own, and HTTP clients for the web process."""

import http.client
import json
import signal
import subprocess
import time
import urllib.request
from urllib.parse import urlsplit

import redis

from tests.conftest import free_port

# Greedy decoding keeps this prompt going to the token limit: a reply long enough to break things under.
LONG_PROMPT = "Count from 1 to 200, separated by commas."
# An instruct model answers in a sentence: these replies write on to max_tokens.
LONG_REPLY = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}


class RedisServer:
    """A Redis server of the test's own, configured like the machine's (nothing kept on disk), which the
    test can stop and start again on the same port: a real restart that loses every stream and queue."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


class EventStream:
    """A browser's view of a turn's Server-Sent Events over a real connection, read event by event."""

    def __init__(self, url: str, *, session_cookie: str, last_event_id: str | None = None) -> None:
        parts = urlsplit(url)
        self.connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=60)
        headers = {"Cookie": f"sessionid={session_cookie}", "Accept": "text/event-stream"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        self.connection.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers)
        self.response = self.connection.getresponse()
        self.last_id: str | None = last_event_id

    def events(self):
        """(type, data) for each event until the stream ends; the connection's drop ends it too."""
        kind, data = "message", ""
        try:
            for raw in self.response:
                line = raw.decode().rstrip("\n")
                if line.startswith("id: "):
                    self.last_id = line[4:]
                elif line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    data = line[6:]
                elif not line and data:
                    yield kind, json.loads(data)
                    kind, data = "message", ""
        except (OSError, http.client.HTTPException):
            return

    def close(self) -> None:
        self.connection.close()


def post_json(url: str, body: dict, *, key: str, timeout: float = 180) -> tuple[int, dict]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
