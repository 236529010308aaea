"""The admin as operators use it: runtime records are read-only, and changes go through actions that call
the product's services, which refuse what they refuse anywhere else."""

import pytest
from django.urls import reverse

from chatapp.models import Message, Turn
from chatapp.turns import admission
from chatapp.turns.lifecycle import turn_fail
from router.models import AssignmentMove, Node
from router.services import assignment_move
from tests.factories import ConversationFactory, MessageFactory, NodeFactory


def _act(admin_client, model: str, action: str, *objects) -> str:
    response = admin_client.post(
        reverse(f"admin:{model}_changelist"),
        {"action": action, "_selected_action": [o.pk for o in objects]},
        follow=True,
    )
    assert response.status_code == 200
    return response.content.decode()


def test_runtime_records_cannot_be_changed_through_a_form(admin_client, idle_node):
    conversation = ConversationFactory.create()
    turn = admission.turn_start(conversation=conversation, text="hands off")
    other = NodeFactory.create(name="other")
    assignment_move(session_key=conversation.session_key, node_name=other.name)
    move = AssignmentMove.objects.get(session_key=conversation.session_key)
    message = Message.objects.get(pk=turn.user_message_id)
    attempts = {
        "router_node": (idle_node, {"status": "down", "capacity": 1}),
        "router_assignmentmove": (move, {"to_node": "nowhere"}),
        "chatapp_message": (message, {"pinned": "on", "content": "changed"}),
        "chatapp_turn": (turn, {"status": "done"}),
    }
    for model, (record, data) in attempts.items():
        url = reverse(f"admin:{model}_change", args=[record.pk])
        assert admin_client.get(url).status_code == 200, model  # it can be read
        assert admin_client.post(url, data).status_code == 403, model
        assert admin_client.get(reverse(f"admin:{model}_add")).status_code == 403, model
    assert Node.objects.get(pk=idle_node.pk).status == Node.Status.UP
    assert AssignmentMove.objects.get(pk=move.pk).to_node == other.name
    assert Message.objects.get(pk=message.pk).content == "hands off"
    assert Turn.objects.get(pk=turn.pk).status == Turn.Status.QUEUED


def test_turn_actions_call_the_lifecycle_and_report_its_refusals(admin_client, idle_node):
    queued = admission.turn_start(conversation=ConversationFactory.create(), text="stop me")
    _act(admin_client, "chatapp_turn", "cancel", queued)
    assert Turn.objects.get(pk=queued.pk).status == Turn.Status.CANCELLED

    failed = admission.turn_start(conversation=ConversationFactory.create(), text="try me again")
    turn_fail(turn_id=failed.pk, attempt=failed.attempt, error="the node fell over")
    page = _act(admin_client, "chatapp_turn", "retry", failed, queued)
    retried = Turn.objects.get(pk=failed.pk)
    assert (retried.status, retried.attempt) == (Turn.Status.QUEUED, failed.attempt + 1)
    assert f"Turn {failed.pk} sent again." in page
    assert f"Turn {queued.pk}: Only a failed reply can be retried." in page
    assert Turn.objects.get(pk=queued.pk).status == Turn.Status.CANCELLED


def test_message_flags_change_through_the_chat_service_and_its_limits(admin_client, idle_node, settings):
    settings.CHAT_MAX_PINS_PER_CONVERSATION = 1
    conversation = ConversationFactory.create()
    first, second = (MessageFactory.create(conversation=conversation, content=text) for text in ("one", "two"))
    _act(admin_client, "chatapp_message", "pin_messages", first)
    _act(admin_client, "chatapp_message", "exclude_messages", first)
    page = _act(admin_client, "chatapp_message", "pin_messages", second)
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.pinned, first.excluded, second.pinned) == (True, True, False)
    assert f"Message {second.pk}: This conversation has 1 pinned messages" in page


@pytest.mark.parametrize("url", ["admin:chatapp_turn_changelist", "admin:chatapp_conversation_change"])
def test_timings_are_rounded_and_carry_their_units(admin_client, idle_node, url):
    turn = admission.turn_start(conversation=ConversationFactory.create(), text="how long?")
    Turn.objects.filter(pk=turn.pk).update(queue_ms=92.38802200001506, ttft_ms=1234.5, decode_tokens_per_s=41.26)
    args = [turn.conversation_id] if url.endswith("_change") else []
    page = admin_client.get(reverse(url, args=args)).content.decode()
    assert "92 ms" in page and "1,234 ms" in page and "41.3 tokens/s" in page
    assert "92.388" not in page


def test_a_conversations_page_shows_its_session_timeline_with_the_routers_moves(admin_client, idle_node):
    conversation = ConversationFactory.create()
    first = admission.turn_start(conversation=conversation, text="one")
    turn_fail(turn_id=first.pk, attempt=first.attempt, error="the node fell over")
    Turn.objects.filter(pk=first.pk).update(prompt_tokens=40, cached_tokens=0, ttft_ms=120.4)
    NodeFactory.create(name="other")
    assignment_move(session_key=conversation.session_key, node_name="other", reason="node down or draining")
    second = admission.turn_start(conversation=conversation, text="two")
    assert second.node == "other"

    page = admin_client.get(reverse("admin:chatapp_conversation_change", args=[conversation.pk])).content.decode()
    timeline = page.split("Session timeline", 1)[1]
    moved = timeline.index("router moved the session from idle to other: node down or draining")
    assert timeline.index(f"<td>{first.pk}</td>") < moved < timeline.index(f"<td>{second.pk}</td>")
    assert "40 / 0 / 40" in timeline and "120 ms" in timeline
    assert 'src="data:image/png;base64,' in timeline
