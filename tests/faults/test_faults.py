"""Parts failing under a streaming reply, each on real processes: Redis and Postgres restarting, the web
process killed and started again, clients going away. In every case the user's message is kept, the
reply is stored exactly once (or the turn is marked failed, with Retry), and the system recovers by itself.
(A node killed mid-reply: tests/chatapp/test_failover.py.)"""

import http.client
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from urllib.parse import urlsplit

import pytest
import redis
from django.db import connection

from chatapp import streams
from chatapp.api.keys import api_key_create
from chatapp.models import Message, Turn
from chatapp.turns import admission
from inference.model_files import DEFAULT_MODEL
from router.models import Node
from tests.conftest import free_port, start_node, start_web, stop_node
from tests.factories import ConversationFactory, UserFactory
from tests.faults.helpers import LONG_PROMPT, LONG_REPLY, EventStream, RedisServer, post_json
from tests.helpers import wait_for_turn, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def reply_text(turn: Turn) -> str:
    assert turn.assistant_message is not None, f"turn {turn.pk} stored no reply"
    return turn.assistant_message.content


def replies_stored(turn: Turn) -> int:
    return Message.objects.filter(conversation_id=turn.conversation_id, role="assistant").count()


def chat(url: str, key: str, text: str, **sampling) -> tuple[int, dict]:
    body = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": text}], **sampling}
    return post_json(f"{url}/v1/chat/completions", body, key=key)


def in_background(call: Callable) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", call()), daemon=True)
    thread.start()
    return thread, result


# Redis --------------------------------------------------------------------------


@pytest.fixture
def private_stack(test_database):
    """A node and a web process on a Redis of the test's own, so the test can restart it."""
    server = RedisServer()
    server.start()
    env = {"REDIS_URL": server.url, "CHAT_LOST_TURN_SECONDS": "3", "CHAT_SSE_BLOCK_MS": "1000"}
    name = f"private-{uuid.uuid4().hex[:6]}"
    node = start_node(name, test_database, **env)
    web, url = start_web(test_database, log_name="web-private", env=env)
    # Only this stack's node takes turns: the suite's own node (on the shared Redis) is marked down once
    # its heartbeat has re-registered it after the previous test's table flush, so it stays down.
    wait_until(lambda: Node.objects.filter(name=name, status=Node.Status.UP).exists(), what="the node registered")
    time.sleep(1)
    Node.objects.exclude(name=name).update(status=Node.Status.DOWN)
    yield SimpleNamespace(redis=server, url=url, node=name)
    stop_node(web)
    stop_node(node)
    server.stop()


def test_redis_restarting_mid_reply_loses_nothing(private_stack, user):
    _, key = api_key_create(owner=user, name="faults")
    thread, result = in_background(lambda: chat(private_stack.url, key, LONG_PROMPT, **LONG_REPLY))
    turn = wait_until(lambda: Turn.objects.filter(status=Turn.Status.RUNNING).first(), what="a running turn")
    probe = redis.Redis.from_url(private_stack.redis.url)
    wait_until(lambda: probe.xlen(streams.stream_key(turn.stream_name)) >= 6, what="tokens streamed")

    private_stack.redis.stop()  # every stream and queued task is gone with it
    time.sleep(1)
    private_stack.redis.start()

    thread.join(timeout=180)
    status, body = result["value"]
    turn.refresh_from_db()
    assert turn.status == Turn.Status.DONE, turn.error
    assert status == 200, body
    # The API answers with the reply as stored, once, after the user's message, also stored once.
    assert body["choices"][0]["message"]["content"] == reply_text(turn)
    assert replies_stored(turn) == 1
    assert Message.objects.filter(conversation_id=turn.conversation_id, role="user").count() == 1
    # Recovered without help: the same web process and node serve the next request.
    status, body = chat(private_stack.url, key, "Say hello.", max_tokens=8)
    assert status == 200 and body["choices"][0]["message"]["content"], body


def test_a_turn_sent_while_redis_is_down_runs_once_it_is_back(private_stack, user):
    _, key = api_key_create(owner=user, name="faults")
    private_stack.redis.stop()
    thread, result = in_background(lambda: chat(private_stack.url, key, "What is the capital of France?", max_tokens=8))
    # The message and its turn are stored although the broker is down: nothing the user sent is lost.
    turn = wait_until(lambda: Turn.objects.first(), what="the turn stored")
    assert turn.status == Turn.Status.QUEUED and turn.user_message.content == "What is the capital of France?"
    time.sleep(2)
    private_stack.redis.start()

    thread.join(timeout=180)
    status, body = result["value"]
    turn.refresh_from_db()
    assert status == 200, body
    assert turn.status == Turn.Status.DONE and turn.attempt >= 1  # its lost task was sent again
    assert body["choices"][0]["message"]["content"] == reply_text(turn)
    assert replies_stored(turn) == 1


# Postgres -----------------------------------------------------------------------


def restart_postgres() -> None:
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    subprocess.run(["pg_ctlcluster", "--skip-systemctl-redirect", version, "main", "restart"], check=True)
    connection.close()  # this test process's connection went with it


def test_postgres_restarting_mid_reply_loses_nothing(node, asgi_server):
    conversation = ConversationFactory.create()
    turn = admission.turn_start(conversation=conversation, text=LONG_PROMPT, sampling=LONG_REPLY)
    wait_until(lambda: sum(e["type"] == "token" for e in streams.read_all(turn.stream_name)) >= 6, what="tokens")

    restart_postgres()

    turn = wait_for_turn(turn)
    assert turn.status == Turn.Status.DONE, turn.error
    streamed = "".join(e["text"] for e in streams.read_all(turn.stream_name) if e["type"] == "token")
    assert reply_text(turn) == streamed  # the node stored what it streamed, once
    assert replies_stored(turn) == 1
    # Recovered without help: the node takes the next turn, the web process serves pages.
    second = wait_for_turn(admission.turn_start(conversation=conversation, text="Thanks!", sampling={"max_tokens": 8}))
    assert second.status == Turn.Status.DONE, second.error
    with urllib.request.urlopen(f"{asgi_server}/login/", timeout=10) as page:
        assert page.status == 200


# The web process and its clients ------------------------------------------------------


@pytest.fixture
def signed_in(client):
    user = UserFactory.create()
    client.force_login(user)
    return SimpleNamespace(user=user, cookie=client.cookies["sessionid"].value)


def events_url(url: str, turn: Turn) -> str:
    return f"{url}/c/{turn.conversation_id}/turns/{turn.pk}/events/"


def read_tokens(stream: EventStream, texts: list[str], *, at_most: int | None = None) -> str | None:
    """Append the stream's token texts to `texts`; the end event's type, or None if stopped or cut."""
    for kind, data in stream.events():
        if kind == "token":
            texts.append(data["text"])
            if at_most and len(texts) >= at_most:
                return None
        elif kind in {"done", "error"}:
            return kind
    return None


def test_the_web_process_killed_mid_stream_and_restarted_resumes_without_loss(node, signed_in, test_database):
    port = free_port()
    web, url = start_web(test_database, port=port, log_name="web-restart")
    conversation = ConversationFactory.create(owner=signed_in.user)
    turn = admission.turn_start(conversation=conversation, text=LONG_PROMPT, sampling=LONG_REPLY)
    texts: list[str] = []
    first = EventStream(events_url(url, turn), session_cookie=signed_in.cookie)
    read_tokens(first, texts, at_most=5)

    web.send_signal(signal.SIGKILL)
    web.wait()
    assert read_tokens(first, texts) is None  # the connection dropped mid-reply
    turn.refresh_from_db()
    assert not turn.is_finished
    web, _ = start_web(test_database, port=port, log_name="web-restart")
    try:
        # As EventSource does: reconnect with the last id seen, and get the rest.
        resumed = EventStream(events_url(url, turn), session_cookie=signed_in.cookie, last_event_id=first.last_id)
        assert read_tokens(resumed, texts) == "done"
    finally:
        stop_node(web)
    turn = wait_for_turn(turn)
    assert "".join(texts) == reply_text(turn)  # nothing lost, nothing repeated
    assert replies_stored(turn) == 1


def test_a_browser_that_goes_away_mid_stream_still_gets_its_reply_stored(node, signed_in, asgi_server):
    conversation = ConversationFactory.create(owner=signed_in.user)
    turn = admission.turn_start(conversation=conversation, text=LONG_PROMPT, sampling=LONG_REPLY)
    stream = EventStream(events_url(asgi_server, turn), session_cookie=signed_in.cookie)
    read_tokens(stream, [], at_most=3)
    stream.close()  # the tab closed: the reply goes on, for when the person comes back

    turn = wait_for_turn(turn)
    assert turn.status == Turn.Status.DONE and turn.finish_reason == "length"
    texts: list[str] = []
    assert read_tokens(EventStream(events_url(asgi_server, turn), session_cookie=signed_in.cookie), texts) == "done"
    assert "".join(texts) == reply_text(turn)
    assert replies_stored(turn) == 1


def test_an_api_client_that_goes_away_mid_stream_stops_its_turn(node, asgi_server, user):
    _, key = api_key_create(owner=user, name="faults")
    parts = urlsplit(asgi_server)
    api = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    body = {"model": DEFAULT_MODEL, "stream": True, "messages": [{"role": "user", "content": LONG_PROMPT}]}
    api.request(
        "POST",
        "/v1/chat/completions",
        body=json.dumps(body | LONG_REPLY),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
    )
    response = api.getresponse()
    chunks = 0
    for line in response:
        chunks += line.startswith(b"data: ")
        if chunks >= 5:
            break
    api.close()

    turn = wait_for_turn(Turn.objects.get())
    assert turn.status == Turn.Status.CANCELLED and turn.finish_reason == "cancelled"
    assert (
        turn.completion_tokens and 0 < turn.completion_tokens < LONG_REPLY["max_tokens"]
    )  # stopped early; the part written is kept
    assert replies_stored(turn) <= 1
    assert Message.objects.filter(conversation_id=turn.conversation_id, role="user").count() == 1
