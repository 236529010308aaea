"""Deleting a conversation, as the admin does it, on a real node: its reply stops, its rows go, the router
forgets its session, and the node drops the session's cached state in its context, RAM and disk tier."""

import uuid

import pytest
from django.urls import reverse

from chatapp import streams
from chatapp.models import Conversation, Message, Summary, Turn
from chatapp.turns import admission
from inference.kv_disk import file_name
from router.models import Node, SessionAssignment
from tests.conftest import NODE_KV_DIR, OUTPUT_DIR, start_node, stop_node
from tests.factories import ConversationFactory
from tests.faults.helpers import LONG_PROMPT, LONG_REPLY
from tests.helpers import only_these_nodes, wait_for_turn, wait_until

pytestmark = pytest.mark.django_db(transaction=True)
SHORT = {"max_tokens": 8, "temperature": 0}


def _held(node: str) -> dict[str, str]:
    return Node.objects.get(name=node).stats.get("sessions", {})


def test_deleting_a_conversation_stops_its_reply_and_ends_its_session_everywhere(test_database, admin_client):
    name = f"delete-{uuid.uuid4().hex[:6]}"
    process = start_node(name, test_database, MAX_REPLY_TOKENS="300", IGNORE_EOS="on", KV_DISK_IDLE_S="0.5")
    try:
        only_these_nodes(name)
        conversation = ConversationFactory.create()
        key = conversation.session_key
        first = wait_for_turn(
            admission.turn_start(conversation=conversation, text="My locker code is 4512.", sampling=SHORT)
        )
        assert first.status == Turn.Status.DONE, first.error
        state_file = NODE_KV_DIR / first.model / file_name(key)
        wait_until(lambda: state_file.exists() and _held(name).get(key) == "resident", 15, "the session's state")
        running = admission.turn_start(conversation=conversation, text=LONG_PROMPT, sampling=LONG_REPLY)
        wait_until(lambda: len(streams.text_so_far(running.stream_name)) > 20, what="the node to start replying")
        counted = Node.objects.get(name=name).sessions

        response = admin_client.post(
            reverse("admin:chatapp_conversation_delete", args=[conversation.pk]), {"post": "yes"}
        )

        assert response.status_code == 302
        assert not Conversation.objects.filter(pk=conversation.pk).exists()
        for model in (Message, Turn, Summary):
            assert not model.objects.filter(conversation_id=conversation.pk).exists(), model.__name__
        assert not SessionAssignment.objects.filter(session_key=key).exists()
        wait_until(lambda: Node.objects.get(name=name).sessions == counted - 1, 10, "its heartbeat to uncount it")
        # The reply stops at its next token; the node then forgets the session and deletes its file.
        wait_until(lambda: key not in _held(name) and not state_file.exists(), 30, "the node to end the session")
        assert "Traceback" not in (OUTPUT_DIR / f"node-{name}.log").read_text()
        again = wait_for_turn(
            admission.turn_start(conversation=ConversationFactory.create(), text="Still there?", sampling=SHORT)
        )
        assert again.status == Turn.Status.DONE and again.node == name
    finally:
        stop_node(process)
