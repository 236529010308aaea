"""Nothing stuck, nothing written twice, on real processes: a node killed and started again under its own
name, the only node dying, a node stalled past the node timeout, a clean shutdown with queued turns, one
key flooding the cluster, a body too large and an API request past its timeout."""

import contextlib
import http.client
import json
import os
import signal
import socket
import threading
import time
import uuid
from urllib.parse import urlsplit

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from chatapp import streams
from chatapp.api.keys import api_key_create
from chatapp.models import Conversation, Message, Turn
from chatapp.turns import admission
from inference.model_files import DEFAULT_MODEL
from router.models import Node
from router.services import assignment_move
from tests.conftest import PRODUCT_DB_OPTIONS, start_node, start_web, stop_node
from tests.factories import ConversationFactory, NodeFactory, UserFactory
from tests.faults.helpers import LONG_PROMPT, LONG_REPLY
from tests.helpers import only_these_nodes, wait_for_turn, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
LONG_REPLIES = {"MAX_REPLY_TOKENS": "300", "IGNORE_EOS": "on"}


def text_streamed(turn: Turn) -> str:
    return streams.text_so_far(turn.stream_name)


def replies(turn: Turn) -> list[str]:
    return list(
        Message.objects.filter(conversation_id=turn.conversation_id, role="assistant").values_list("content", flat=True)
    )


class ApiStream:
    """A streaming chat completion read in a thread: its text, its error chunks, and whether [DONE] came."""

    def __init__(self, url: str, key: str, messages: list[dict], *, session: str, **params) -> None:
        self.text: list[str] = []
        self.errors: list[dict] = []
        self.status: int | None = None
        self.done = False
        body = {"model": DEFAULT_MODEL, "stream": True, "messages": messages, **params}
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", "X-Session-ID": session}
        self._thread = threading.Thread(target=self._read, args=(url, body, headers), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict, headers: dict) -> None:
        parts = urlsplit(url)
        connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=240)
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        response = connection.getresponse()
        self.status = response.status
        for raw in response:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                self.done = True
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                if "error" in data:
                    self.errors.append(data["error"])
                for choice in data.get("choices", []):
                    self.text.append(choice["delta"].get("content") or "")
        connection.close()

    def join(self, timeout: float = 240) -> None:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the client's stream never ended"


def post(url: str, key: str, messages: list[dict], *, session: str, **params) -> tuple[int, dict, dict]:
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=240)
    body = {"model": DEFAULT_MODEL, "messages": messages, **params}
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", "X-Session-ID": session}
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    response = connection.getresponse()
    payload = json.loads(response.read())
    connection.close()
    return response.status, payload, dict(response.getheaders())


@pytest.fixture
def api_user():
    user = UserFactory.create()
    return user, api_key_create(owner=user, name="faults")[1]


def _recovery_web(test_database, *, orphan_seconds: int):
    """A web process that looks for a lost turn every second and gives up on one after `orphan_seconds`
    with no node; an API request waits 20 s for its reply."""
    env = {"CHAT_SSE_BLOCK_MS": "1000", "CHAT_ORPHAN_SECONDS": str(orphan_seconds), "CHAT_API_TIMEOUT_SECONDS": "20"}
    env |= {"ROUTER_NODE_TIMEOUT_SECONDS": "3"}
    web, url = start_web(test_database, log_name="web-recovery", env=env)
    yield url
    stop_node(web)


@pytest.fixture
def quick_web(test_database):
    """Gives up on a turn after 3 s with no node."""
    yield from _recovery_web(test_database, orphan_seconds=3)


@pytest.fixture
def patient_web(test_database):
    """Waits 15 s for a node: room for a killed node to start again on a loaded machine (CI saw a restart
    lose a 3 s race to the web's reaper, which then failed the turn for want of a node)."""
    yield from _recovery_web(test_database, orphan_seconds=15)


def _reply_then_node_killed(test_database, web_url, user, key, name: str) -> tuple[ApiStream, Turn]:
    """A node alone in the cluster starts streaming a long API reply and is SIGKILLed mid-reply (also when
    the test fails before that, so that no node is left behind to take other tests' turns)."""
    process = start_node(name, test_database, **LONG_REPLIES)
    try:
        only_these_nodes(name)
        client = ApiStream(web_url, key, [{"role": "user", "content": LONG_PROMPT}], session="s", **LONG_REPLY)
        turn = wait_until(lambda: Turn.objects.filter(conversation__owner=user).first(), what="the turn")
        wait_until(lambda: len(text_streamed(turn)) > 20, what="the node to start replying")
    finally:
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
    return client, turn


def test_a_node_killed_and_restarted_under_its_own_name_finishes_its_turns(test_database, patient_web, api_user):
    user, key = api_user
    name = f"phoenix-{uuid.uuid4().hex[:6]}"
    client, turn = _reply_then_node_killed(test_database, patient_web, user, key, name)
    process = start_node(name, test_database, **LONG_REPLIES)  # as a supervisor would: under its own name
    try:
        client.join()
        # The client had text already: the stream says the reply restarted instead of repeating it.
        assert client.status == 200 and client.done
        assert [e["code"] for e in client.errors] == ["reply_restarted"]
        turn = wait_for_turn(turn, timeout=60)
        assert (turn.status, turn.node, turn.attempt) == (Turn.Status.DONE, name, 1)  # the restarted node took it

        # The client sends the same request again, as OpenAI clients do after an error: it gets the whole
        # reply of the turn it started, from the new attempt's start, with no second turn and no branch.
        again = ApiStream(patient_web, key, [{"role": "user", "content": LONG_PROMPT}], session="s", **LONG_REPLY)
        again.join()
        assert again.errors == [] and again.done
        assert "".join(again.text) == turn.assistant_message.content  # type: ignore[union-attr]
        assert replies(turn) == [turn.assistant_message.content]  # type: ignore[union-attr]

        # The conversation is not blocked: its next message is answered, by the same node.
        history = [{"role": "user", "content": LONG_PROMPT}, {"role": "assistant", "content": replies(turn)[0]}]
        history.append({"role": "user", "content": "Thanks!"})
        status, body, _ = post(patient_web, key, history, session="s", max_tokens=8)
        assert status == 200, body
        assert Turn.objects.filter(conversation=turn.conversation).count() == 2
        assert Conversation.objects.filter(owner=user).count() == 1  # no branch
    finally:
        stop_node(process)


def test_the_only_node_dying_ends_the_turn_with_a_clear_error(test_database, quick_web, api_user):
    user, key = api_user
    name = f"lonely-{uuid.uuid4().hex[:6]}"
    client, turn = _reply_then_node_killed(test_database, quick_web, user, key, name)

    client.join(timeout=60)  # node timeout (3 s) + no node for CHAT_ORPHAN_SECONDS (3 s), seen by the reader
    assert client.done and [e["code"] for e in client.errors] == ["no_node"]
    turn.refresh_from_db()
    assert turn.status == Turn.Status.FAILED and "No inference node" in turn.error
    # Later messages are told that no node is up (503, Retry-After), not that a reply is still being written.
    status, body, headers = post(quick_web, key, [{"role": "user", "content": "Anyone there?"}], session="s")
    assert status == 503 and body["error"]["code"] == "no_node" and int(headers["Retry-After"]) > 0


def test_a_node_stalled_past_the_timeout_writes_nothing_once_replaced(test_database):
    stalled, spare = (f"{role}-{uuid.uuid4().hex[:6]}" for role in ("stalled", "spare"))
    processes = {name: start_node(name, test_database, **LONG_REPLIES) for name in (stalled, spare)}
    try:
        only_these_nodes(stalled, spare)
        conversation = ConversationFactory.create()
        assignment_move(session_key=conversation.session_key, node_name=stalled)
        turn = admission.turn_start(conversation=conversation, text=LONG_PROMPT, sampling=LONG_REPLY)
        wait_until(lambda: len(text_streamed(turn)) > 20, what="the stalled node to start replying")
        processes[stalled].send_signal(signal.SIGSTOP)  # alive, but silent past ROUTER_NODE_TIMEOUT_SECONDS
        try:
            wait_until(lambda: Turn.objects.get(pk=turn.pk).attempt == 1, what="the spare node to take the turn")
        finally:
            processes[stalled].send_signal(signal.SIGCONT)  # it wakes up mid-reply, on attempt 0
        turn = wait_for_turn(turn)
        assert (turn.status, turn.node, turn.attempt) == (Turn.Status.DONE, spare, 1)
        time.sleep(2)  # the stalled node had time to try to write
        turn.refresh_from_db()
        assert (turn.status, turn.node, turn.attempt) == (Turn.Status.DONE, spare, 1)
        assert replies(turn) == [turn.assistant_message.content]  # type: ignore[union-attr]
        events = streams.read_all(turn.stream_name)
        restart = max(i for i, e in enumerate(events) if e["type"] == "start")
        assert events[restart]["attempt"] == 1
        assert all(e["attempt"] == 1 for e in events[restart:])  # nothing of attempt 0 after the restart
        assert text_streamed(turn) == turn.assistant_message.content  # type: ignore[union-attr]
        # Its own heartbeats bring the stalled node back up.
        wait_until(lambda: Node.objects.get(name=stalled).status == Node.Status.UP, 15, "the stalled node to be up")
    finally:
        for process in processes.values():
            stop_node(process)


def test_a_node_frozen_holding_its_row_lock_is_replaced_all_the_same(test_database):
    """A process frozen mid-transaction keeps its row locks: a node frozen inside its heartbeat kept its own
    row locked, and its peers' reaper, which skips locked node rows, never marked it down (found by the
    stalled-node test above, when SIGSTOP landed inside a heartbeat). Postgres ends such a transaction after
    DB_IDLE_IN_TRANSACTION_TIMEOUT_S."""
    spare = f"spare-{uuid.uuid4().hex[:6]}"
    process = start_node(spare, test_database)
    try:
        only_these_nodes(spare)
        frozen = NodeFactory.create(name=f"frozen-{uuid.uuid4().hex[:6]}")  # up; no process reads its queue
        conversation = ConversationFactory.create()
        assignment_move(session_key=conversation.session_key, node_name=frozen.name)
        turn = admission.turn_start(conversation=conversation, text="Hello!")
        # The frozen node's heartbeat, as it froze: its row locked on a connection made as the product's are
        # (the suite's own has no idle timeout: tests/conftest.py).
        holder = psycopg.connect(**connection.get_connection_params() | {"options": PRODUCT_DB_OPTIONS})
        try:
            holder.execute(f"SELECT 1 FROM {Node._meta.db_table} WHERE name = %s FOR UPDATE", [frozen.name])
            turn = wait_for_turn(turn, timeout=60)
            assert (turn.status, turn.node, turn.attempt) == (Turn.Status.DONE, spare, 1)
            assert Node.objects.get(name=frozen.name).status == Node.Status.UNRESPONSIVE
            with pytest.raises(psycopg.errors.IdleInTransactionSessionTimeout):  # Postgres ended it
                holder.execute("SELECT 1")
        finally:
            holder.close()  # else a failing run's lock would hold up the flush after it
    finally:
        stop_node(process)


@pytest.mark.parametrize("with_spare", [True, False], ids=["handed-to-a-spare", "failed-with-no-spare"])
def test_a_clean_shutdown_hands_off_its_queued_turns(test_database, with_spare):
    leaving = f"leaving-{uuid.uuid4().hex[:6]}"
    names = [leaving, f"spare-{uuid.uuid4().hex[:6]}"] if with_spare else [leaving]
    env = LONG_REPLIES | {"MAX_CONCURRENT": "1"}  # one reply at a time: the others wait in its queue
    processes = {name: start_node(name, test_database, **env) for name in names}
    try:
        only_these_nodes(*names)
        Node.objects.filter(name__in=names[1:]).update(status=Node.Status.DOWN)  # every turn goes to `leaving`
        turns = []
        for k in range(3):
            conversation = ConversationFactory.create()
            assignment_move(session_key=conversation.session_key, node_name=leaving)
            sampling = {"max_tokens": 300 if k == 0 else 8, "temperature": 0}  # outlasts starting the others
            turns.append(admission.turn_start(conversation=conversation, text=LONG_PROMPT, sampling=sampling))
        wait_until(lambda: Turn.objects.get(pk=turns[0].pk).status == Turn.Status.RUNNING, what="the first reply")
        Node.objects.filter(name__in=names[1:]).update(status=Node.Status.UP)
        # SIGTERM: a warm shutdown, which waits for the 300-token reply. On a busy machine that takes longer
        # than the usual 20 s, and a node killed mid-reply would fail the test for the wrong reason.
        stop_node(processes.pop(leaving), timeout=90)

        first, *queued = [wait_for_turn(t, timeout=90) for t in turns]
        assert (first.status, first.node, first.attempt) == (Turn.Status.DONE, leaving, 0)  # finished before it left
        for turn in queued:
            if with_spare:
                assert (turn.status, turn.node, turn.attempt) == (Turn.Status.DONE, names[1], 1), turn.error
            else:
                assert turn.status == Turn.Status.FAILED and "shut down and no other node is up" in turn.error
    finally:
        for process in processes.values():
            stop_node(process)


def test_one_key_flooding_gets_429_and_others_are_still_served(node, asgi_server, api_user):
    _, key = api_user
    _, other_key = api_key_create(owner=UserFactory.create(), name="other")
    results: list[tuple[int, dict, dict]] = []
    start = threading.Barrier(12)

    def one(session: str) -> None:
        start.wait()
        results.append(
            post(asgi_server, key, [{"role": "user", "content": LONG_PROMPT}], session=session, **LONG_REPLY)
        )

    threads = [threading.Thread(target=one, args=(f"flood-{k}",)) for k in range(12)]
    for thread in threads:
        thread.start()
    time.sleep(1)  # the flood is in
    status, body, _ = post(asgi_server, other_key, [{"role": "user", "content": "Hello!"}], session="o", max_tokens=8)
    assert status == 200, body  # someone else is served meanwhile
    for thread in threads:
        thread.join(timeout=240)
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200] * 4 + [429] * 8  # CHAT_USER_MAX_RUNNING_TURNS = 4 at once
    refused = [(body, headers) for status, body, headers in results if status == 429]
    assert all(b["error"]["type"] == "rate_limit_error" and int(h["Retry-After"]) > 0 for b, h in refused)


def read_until_closed(raw: socket.socket) -> str:
    """What the server sent before it closed (a reset, when it closed while the body was still coming)."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := raw.recv(4096):
            received += chunk
    return received.decode()


def test_a_body_over_the_limit_is_refused_before_it_is_sent(asgi_server, api_user):
    _, key = api_user
    parts = urlsplit(asgi_server)
    with socket.create_connection((parts.hostname, parts.port), timeout=10) as raw:
        raw.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {key}\r\nContent-Length: {50 * 2**20}\r\n\r\n".encode()
        )
        answer = read_until_closed(raw)  # the 50 MiB body was never sent
    assert answer.startswith("HTTP/1.1 413") and "request_too_large" in answer

    with socket.create_connection((parts.hostname, parts.port), timeout=10) as raw:  # chunked, no length
        raw.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {key}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
        )
        chunk = b"x" * 2**20
        for _ in range(3):
            raw.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        answer = read_until_closed(raw)
    assert answer.startswith("HTTP/1.1 413") and "request_too_large" in answer


def test_an_api_request_past_its_timeout_gets_an_openai_error_and_its_turn_is_cancelled(quick_web, api_user):
    user, key = api_user
    silent = NodeFactory.create(name=f"silent-{uuid.uuid4().hex[:6]}")  # nothing consumes its queue
    Node.objects.exclude(pk=silent.pk).update(status=Node.Status.DOWN)
    stop = threading.Event()

    def heartbeats() -> None:  # it looks alive all along, so the reply is merely late, never lost
        while not stop.wait(0.5):
            Node.objects.filter(pk=silent.pk).update(last_heartbeat=timezone.now())
        connection.close()  # this thread's own connection

    beating = threading.Thread(target=heartbeats, daemon=True)
    beating.start()
    try:
        status, body, _ = post(quick_web, key, [{"role": "user", "content": "Hello?"}], session="t")
    finally:
        stop.set()
        beating.join()
    assert status == 504 and body["error"]["code"] == "timeout"
    turn = Turn.objects.get(conversation__owner=user)
    assert turn.status == Turn.Status.CANCELLED
