"""A node killed mid-generation: its turn finishes on another node, with nothing lost or doubled."""

import os
import signal
import uuid

import pytest

from chatapp import streams
from chatapp.models import Message, Turn
from chatapp.turns import admission
from router.models import Node
from router.services import assignment_move, healthy_nodes
from tests.conftest import start_node, stop_node
from tests.factories import ConversationFactory
from tests.helpers import wait_for_turn, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
LONG_REPLIES = {"MAX_REPLY_TOKENS": "300", "TEMPERATURE": "0.8", "IGNORE_EOS": "on"}


@pytest.fixture
def doomed_and_spare(test_database):
    names = [f"doomed-{uuid.uuid4().hex[:6]}", f"spare-{uuid.uuid4().hex[:6]}"]
    processes = [start_node(name, test_database, **LONG_REPLIES) for name in names]
    yield list(zip(names, processes, strict=True))
    for process in processes:
        if process.poll() is None:
            stop_node(process)


def test_a_node_killed_mid_generation_hands_its_turn_to_another(doomed_and_spare):
    (doomed, doomed_process), (spare, _) = doomed_and_spare
    Node.objects.exclude(name__in=[doomed, spare]).update(status=Node.Status.DOWN)
    wait_until(lambda: {n.name for n in healthy_nodes()} == {doomed, spare}, 15, "both nodes to register")
    conversation = ConversationFactory.create()
    assignment_move(session_key=conversation.session_key, node_name=doomed)

    turn = admission.turn_start(
        conversation=conversation, text="Tell me a very long story about a dragon and a sailor."
    )
    assert turn.node == doomed
    wait_until(lambda: len(streams.text_so_far(turn.stream_name)) > 20, 60, "the doomed node to start replying")
    os.kill(doomed_process.pid, signal.SIGKILL)

    turn = wait_for_turn(turn, timeout=120)
    assert turn.status == Turn.Status.DONE, turn.error
    assert (turn.node, turn.attempt) == (spare, 1)
    assert Node.objects.get(name=doomed).status == Node.Status.UNRESPONSIVE
    assert Message.objects.filter(pk=turn.user_message_id).exists()
    assert conversation.messages.filter(role=Message.Role.ASSISTANT).count() == 1
    assert turn.assistant_message is not None
    assert streams.text_so_far(turn.stream_name).strip() == turn.assistant_message.content.strip()
