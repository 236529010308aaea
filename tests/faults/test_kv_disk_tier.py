"""A session's KV state outlives its node process: real nodes sharing one disk tier, drained, stopped,
killed and restarted. Each test starts its nodes on a disk tier of its own."""

import os
import signal
import uuid

import pytest

from chatapp.models import Turn
from chatapp.turns import admission
from router.models import Node
from router.services import assignment_move, node_set_status
from tests.conftest import start_node, stop_node
from tests.factories import ConversationFactory
from tests.helpers import only_these_nodes, wait_for_turn, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def nodes_on_one_tier(test_database, tmp_path):
    """start(name, **env): a node on this test's disk tier; all are stopped at the end."""
    processes: list = []

    def start(name: str, **env: str):
        process = start_node(name, test_database, KV_DISK_PATH=str(tmp_path), **env)
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            stop_node(process)


def _turn(conversation, text: str) -> Turn:
    turn = wait_for_turn(admission.turn_start(conversation=conversation, text=text))
    assert turn.status == Turn.Status.DONE, turn.error
    return turn


def _held(turn: Turn) -> int:
    """Tokens the session's cache holds after `turn`: its prompt and its reply."""
    return (turn.prompt_tokens or 0) + (turn.completion_tokens or 0)


def _disk_sessions(name: str) -> int:
    return Node.objects.get(name=name).stats.get("disk_sessions", 0)


def test_a_drained_nodes_sessions_resume_from_its_state_on_the_node_they_move_to(nodes_on_one_tier):
    draining, neighbour = (f"{role}-{uuid.uuid4().hex[:6]}" for role in ("draining", "neighbour"))
    nodes_on_one_tier(draining, KV_DISK_IDLE_S="0")  # no write-behind: the drain alone writes the session
    nodes_on_one_tier(neighbour)
    only_these_nodes(draining, neighbour)
    conversation = ConversationFactory.create()
    assignment_move(session_key=conversation.session_key, node_name=draining)
    first = _turn(conversation, "My sister Ana keeps three goats on her farm near Porto.")
    assert first.node == draining

    node_set_status(name=draining, status=Node.Status.DRAINING)
    wait_until(lambda: _disk_sessions(draining) >= 1, 30, "the draining node to write its idle session")
    second = _turn(conversation, "What does my sister keep?")

    assert second.node == neighbour
    assert second.cache_source == Turn.CacheSource.OTHER_NODE
    assert (second.cached_tokens or 0) >= _held(first)


@pytest.mark.parametrize(
    "stop",
    [pytest.param(signal.SIGTERM, id="clean-shutdown"), pytest.param(signal.SIGKILL, id="killed-after-write-behind")],
)
def test_a_node_restarted_under_its_name_resumes_its_sessions_from_disk(nodes_on_one_tier, stop):
    name = f"restarted-{uuid.uuid4().hex[:6]}"
    settings = {"KV_DISK_IDLE_S": "0.3"} if stop == signal.SIGKILL else {"KV_DISK_IDLE_S": "0"}
    process = nodes_on_one_tier(name, **settings)
    only_these_nodes(name)
    conversation = ConversationFactory.create()
    first = _turn(conversation, "My sister Ana keeps three goats on her farm near Porto.")
    if stop == signal.SIGKILL:  # only what the write-behind put on disk survives
        wait_until(lambda: _disk_sessions(name) >= 1, 30, "the idle session to be written")

    os.kill(process.pid, stop)
    process.wait(timeout=60)
    nodes_on_one_tier(name, **settings)
    second = _turn(conversation, "What does my sister keep?")

    assert second.node == name
    assert second.cache_source == Turn.CacheSource.DISK
    assert (second.cached_tokens or 0) >= _held(first)
