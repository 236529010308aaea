"""Accepting a message: what is stored, what is refused (no node needed)."""

import pytest

from chatapp.models import Message, Turn
from chatapp.turns import admission
from chatapp.validation import TurnRejected
from router.models import Node
from tests.factories import ConversationFactory


@pytest.mark.parametrize(
    ("text", "reason"),
    [("", "empty"), ("   \n\t  ", "empty"), ("\x00\x01\x07", "empty"), ("x" * 8001, "limit is 8,000")],
)
def test_bad_messages_are_refused_and_nothing_is_stored(db, text, reason):
    conversation = ConversationFactory.create()
    with pytest.raises(TurnRejected, match=reason):
        admission.turn_start(conversation=conversation, text=text)
    assert Message.objects.count() == 0
    assert Turn.objects.count() == 0


def test_control_characters_are_removed_and_text_kept(db, idle_node):
    conversation = ConversationFactory.create(title="")
    turn = admission.turn_start(conversation=conversation, text="  hello\x00 wor\x1bld\n  ")
    assert turn.user_message.content == "hello world"
    conversation.refresh_from_db()
    assert conversation.title == "hello world"


def test_second_message_waits_for_the_reply_in_progress(db, idle_node):
    conversation = ConversationFactory.create()
    admission.turn_start(conversation=conversation, text="first")
    with pytest.raises(TurnRejected, match="still being written"):
        admission.turn_start(conversation=conversation, text="second")
    assert list(Message.objects.values_list("content", flat=True)) == ["first"]


def test_turn_records_router_node_and_strategy(db, idle_node):
    conversation = ConversationFactory.create(strategy="full")
    turn = admission.turn_start(conversation=conversation, text="hi")
    assert (turn.node, turn.strategy, turn.status) == (idle_node.name, "full", Turn.Status.QUEUED)


def test_no_node_up_refuses_the_message_and_stores_nothing(db):
    Node.objects.update(status=Node.Status.DOWN)
    with pytest.raises(TurnRejected, match="No inference node serves the model"):
        admission.turn_start(conversation=ConversationFactory.create(), text="hello?")
    assert not Message.objects.exists()
