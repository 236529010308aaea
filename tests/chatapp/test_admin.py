"""The admin as operators use it: runtime records are read-only, and changes go through actions that call
the product's services, which refuse what they refuse anywhere else."""

import re
from datetime import timedelta
from html import escape, unescape

import pytest
from django.urls import reverse
from django.utils import timezone

from chatapp import turn_inspection
from chatapp.memory.assembly import prompt_record, turn_prompt
from chatapp.models import Conversation, Message, Turn
from chatapp.turns import admission, lifecycle
from chatapp.turns.lifecycle import turn_fail, turn_record_prompt
from chatapp.validation import NoNodeUp
from inference.types import Sampling
from router.models import AssignmentMove, Node, NodeSample, SessionAssignment
from router.services import ServedModel, assignment_move, node_heartbeat
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
    assignment = SessionAssignment.objects.get(session_key=conversation.session_key)
    attempts = {
        "router_node": (idle_node, {"status": "down", "capacity": 1}),
        "router_assignmentmove": (move, {"to_node": "nowhere"}),
        "router_sessionassignment": (assignment, {"node": idle_node.pk}),
        "chatapp_message": (message, {"pinned": "on", "content": "changed"}),
        "chatapp_turn": (turn, {"status": "done"}),
    }
    for model, (record, data) in attempts.items():
        url = reverse(f"admin:{model}_change", args=[record.pk])
        assert admin_client.get(url).status_code == 200, model  # it can be read
        assert admin_client.post(url, data).status_code == 403, model
        assert admin_client.get(reverse(f"admin:{model}_add")).status_code == 403, model
        delete = reverse(f"admin:{model}_delete", args=[record.pk])
        assert admin_client.post(delete, {"post": "yes"}).status_code == 403, model
    assert Node.objects.get(pk=idle_node.pk).status == Node.Status.UP
    assert AssignmentMove.objects.get(pk=move.pk).to_node == other.name
    assert SessionAssignment.objects.get(pk=assignment.pk).node == other
    assert Message.objects.get(pk=message.pk).content == "hands off"
    assert Turn.objects.get(pk=turn.pk).status == Turn.Status.QUEUED
    # A conversation's title can be edited; its model and strategy change only through the chat's services.
    url = reverse("admin:chatapp_conversation_change", args=[conversation.pk])
    fields = {"title": "Renamed", "strategy": "full", "model": "gemma-3-270m", "user_name": "U", "assistant_name": "A"}
    inlines = {f"{p}-{k}": "0" for p in ("messages", "turns") for k in ("TOTAL_FORMS", "INITIAL_FORMS")}
    assert admin_client.post(url, fields | inlines).status_code == 302
    conversation.refresh_from_db()
    assert (conversation.title, conversation.strategy) == ("Renamed", "stable_prefix")
    assert conversation.model != "gemma-3-270m"


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
    assert timeline.index(f">{first.pk}</a></td>") < moved < timeline.index(f">{second.pk}</a></td>")
    assert "40 / 0 / 40" in timeline and "120 ms" in timeline
    assert 'src="data:image/png;base64,' in timeline


def _visible_text(html: str) -> str:
    return unescape(re.sub(r"<[^>]+>", "", html))


def test_a_turns_page_shows_its_prompt_segment_by_segment_with_markers_apart(admin_client, engine, settings):
    settings.CHAT_MEMORY_STRATEGIES = {
        "small_pinned": {
            "BACKEND": "chatapp.memory.strategies.StablePrefix",
            "OPTIONS": {"high": 200, "low": 80, "pinned": True},
        }
    }
    conversation = ConversationFactory.create(strategy="small_pinned", system_prompt="You are terse.")
    pinned = MessageFactory.create(conversation=conversation, content="My cat is called Miso.", pinned=True)
    for i in range(12):
        MessageFactory.create(conversation=conversation, content=f"Day {i}: we walked along the river.")
        MessageFactory.create(conversation=conversation, role=Message.Role.ASSISTANT, content=f"Lovely ({i}).")
    question = MessageFactory.create(conversation=conversation, content="What is my cat called? <b>bold</b>")
    turn = Turn.objects.create(
        conversation=conversation, user_message=question, strategy="small_pinned", status=Turn.Status.RUNNING
    )
    prompt = turn_prompt(
        turn=turn, engine=engine, sampling=Sampling(max_tokens=16, temperature=0, top_p=1, repeat_penalty=1)
    )
    assert turn_record_prompt(turn=turn, fields=prompt_record(turn, prompt, engine.chat_format))
    Turn.objects.filter(pk=turn.pk).update(prompt_tokens=len(prompt.tokens), cached_tokens=0)
    turn.refresh_from_db()
    assert turn.prompt_text == engine.chat_format.display(prompt.tokens)  # the parts add up to the prompt

    page = admin_client.get(reverse("admin:chatapp_turn_change", args=[turn.pk])).content.decode()

    shown = page.split('<pre class="prompt">', 1)[1].split("</pre>", 1)[0]
    assert _visible_text(shown) == turn.prompt_text  # all of it, in order, and the user's HTML stays text
    assert "&lt;b&gt;bold&lt;/b&gt;" in shown
    opening = escape(engine.chat_format.spec.open["user"])
    assert f'<span class="marker" title="template marker">{opening}' in shown
    kinds = [s["kind"] for s in turn.trace["segments"]]
    assert kinds[:2] == ["system", "pinned"] and kinds[-1] == "verbatim"
    new = len(kinds) - 1
    assert re.search(
        rf'<span class="segment-verbatim new-message" title="segment {new}: new message">What is my cat', shown
    )
    assert re.search(r'<span class="segment-pinned" title="segment 1: pinned messages and facts">Things to', shown)
    segments = page.split('<table class="prompt-segments">', 1)[1].split("</table>", 1)[0]
    for index, segment in enumerate(turn.trace["segments"]):
        assert (
            f"<td>{index}</td><td>{turn_inspection.segment_label(turn, index)}</td><td>{segment['tokens']}</td>"
            in segments
        )
    template_tokens = turn.prompt_tokens - sum(s["tokens"] for s in turn.trace["segments"])
    assert f"the template's own markers</td><td>{template_tokens}</td>" in segments.replace("&#x27;", "'")
    assert reverse("admin:chatapp_message_change", args=[pinned.pk]) in segments
    assert turn.trace["dropped"]
    for dropped in turn.trace["dropped"]:
        assert f'<a href="{reverse("admin:chatapp_message_change", args=[dropped])}">#{dropped}</a>' in page
    assert reverse("admin:chatapp_conversation_change", args=[conversation.pk]) in page
    # Replaying the conversation under every strategy is asked for, not done on every view.
    assert 'href="?what_if=1#what-if"' in page and "(used)" not in page
    NodeFactory.create(name="limits", n_ctx=engine.n_ctx, max_reply_tokens=16)
    Turn.objects.filter(pk=turn.pk).update(status=Turn.Status.DONE, node="limits")
    url = reverse("admin:chatapp_turn_change", args=[turn.pk])
    what_if = admin_client.get(url, {"what_if": "1"}).content.decode().split('<div id="what-if">', 1)[1]
    assert "small_pinned (used)" in what_if and "<th>computed</th>" in what_if


def test_a_turns_page_shows_its_attempts_and_links_to_its_node_and_assignment(admin_client, idle_node):
    turn = admission.turn_start(conversation=ConversationFactory.create(), text="again and again")
    other = NodeFactory.create(name="other")
    Node.objects.filter(pk=idle_node.pk).update(status=Node.Status.DOWN)
    assert lifecycle.turn_resend(turn_id=turn.pk, attempt=turn.attempt, why="node idle went down") is True

    page = admin_client.get(reverse("admin:chatapp_turn_change", args=[turn.pk])).content.decode()
    attempts = page.split('<table id="attempts">', 1)[1].split("</table>", 1)[0]
    rows = attempts.split("<tr>")[2:]
    assert len(rows) == 2
    assert "<td>0</td><td>idle</td><td>queued</td>" in rows[0] and "node idle went down" in rows[0]
    assert "<td>1</td><td>other</td><td>queued</td>" in rows[1] and "(current)" in rows[1]
    assert reverse("admin:router_node_change", args=[other.pk]) in page
    assignment = SessionAssignment.objects.get(session_key=turn.conversation.session_key)
    assert reverse("admin:router_sessionassignment_change", args=[assignment.pk]) in page
    assert "attempt history (2)" in page


def _listed(admin_client, **query: str) -> set[int]:
    page = admin_client.get(reverse("admin:chatapp_conversation_changelist"), query).content.decode()
    return {int(pk) for pk in re.findall(r'<a href="/admin/chatapp/conversation/(\d+)/change/', page)}


def test_the_conversation_list_finds_the_sessions_worth_a_look(admin_client, idle_node):
    def conversation_with_turn(**fields) -> Conversation:
        conversation = ConversationFactory.create()
        turn = admission.turn_start(conversation=conversation, text="hello")
        Turn.objects.filter(pk=turn.pk).update(**fields)
        return conversation

    hit = conversation_with_turn(status=Turn.Status.DONE, prompt_tokens=100, cached_tokens=95)
    missed = conversation_with_turn(status=Turn.Status.DONE, prompt_tokens=100, cached_tokens=30)
    failed = conversation_with_turn(status=Turn.Status.FAILED, prompt_tokens=100, cached_tokens=99)
    stuck = conversation_with_turn(queued_at=timezone.now() - timedelta(minutes=10))
    waiting = conversation_with_turn()  # queued a moment ago: not stuck
    NodeFactory.create(name="other")
    assignment_move(session_key=missed.session_key, node_name="other")
    elsewhere = conversation_with_turn(node="other", status=Turn.Status.DONE)

    assert _listed(admin_client, trouble="failed") == {failed.pk}
    assert _listed(admin_client, trouble="stuck") == {stuck.pk}
    assert _listed(admin_client, cache_hit_under="0.5") == {missed.pk}
    assert _listed(admin_client, cache_hit_under="0.9") == {missed.pk}
    assert _listed(admin_client, moved="yes") == {missed.pk}
    assert missed.pk not in _listed(admin_client, moved="no")
    assert _listed(admin_client, node="other") == {elsewhere.pk}
    assert {hit.pk, waiting.pk} <= _listed(admin_client)
    page = admin_client.get(reverse("admin:chatapp_conversation_changelist")).content.decode()
    assert '<td class="field-cache_hit">95%</td>' in page and '<td class="field-cache_hit">30%</td>' in page


def test_a_nodes_page_shows_its_load_over_time_its_sessions_and_its_recent_turns(admin_client, idle_node, settings):
    conversation = ConversationFactory.create()
    turn = admission.turn_start(conversation=conversation, text="where is my state?")
    served = ServedModel(model=idle_node.model, model_path="", chat_template="chatml", n_ctx=4096, max_reply_tokens=64)
    places = {conversation.session_key: "resident", "conversation:999999": "disk"}
    for used in (100, 900, 400):
        stats = {"kv_cells_used": used, "kv_cells_total": 4096, "resident_sessions": 1, "sessions": places}
        node_heartbeat(name="idle", capacity=16, stats=stats, incarnation="", served=served, sample=True)
    samples = NodeSample.objects.filter(node=idle_node)
    assert list(samples.values_list("kv_cells_used", flat=True)) == [100, 900, 400]
    node_heartbeat(name="idle", capacity=16, stats=stats, incarnation="", served=served)  # not a sample
    assert samples.count() == 3

    page = admin_client.get(reverse("admin:router_node_change", args=[idle_node.pk])).content.decode()
    assert '<img src="data:image/png;base64,' in page and "KV use and sessions of idle over time" in page
    row = next(r for r in page.split("<tr>") if conversation.session_key in r)
    assert "assigned here" in row and "resident in its context" in row
    row = next(r for r in page.split("<tr>") if "conversation:999999" in r)
    assert "not assigned here" in row and "in the disk tier" in row
    recent = page.split("Recent turns", 1)[1]
    assert f'<a href="{reverse("admin:chatapp_turn_change", args=[turn.pk])}">{turn.pk}</a>' in recent

    settings.ROUTER_NODE_HISTORY_HOURS = 0  # older samples are forgotten at the next one
    node_heartbeat(name="idle", capacity=16, stats={}, incarnation="", served=served, sample=True)
    assert samples.count() == 1


def test_sessions_move_through_the_routers_service_which_refuses_another_models_node(admin_client, idle_node):
    conversation = ConversationFactory.create()
    admission.turn_start(conversation=conversation, text="move me")
    assignment = SessionAssignment.objects.get(session_key=conversation.session_key)
    NodeFactory.create(name="same-model")
    NodeFactory.create(name="gemma", model="gemma-3-270m")
    NodeFactory.create(name="down", status=Node.Status.DOWN)

    page = _act(admin_client, "router_sessionassignment", "move_to_gemma", assignment)
    assert "Node gemma serves gemma-3-270m, not" in page
    assert "move_to_down" not in page  # only nodes that are up are offered
    page = _act(admin_client, "router_sessionassignment", "move_to_same-model", assignment)
    assert f"Moved {conversation.session_key} to same-model." in page
    assignment.refresh_from_db()
    assert assignment.node.name == "same-model"
    move = AssignmentMove.objects.get(session_key=conversation.session_key)
    assert (move.from_node, move.to_node, move.reason) == ("idle", "same-model", "moved by an operator")
    assert _counted_by_heartbeats("same-model", "idle") == {"same-model": 1, "idle": 0}


def _counted_by_heartbeats(*names: str) -> dict[str, int]:
    """The nodes' session counts after a heartbeat each (the one writer of the figure)."""
    for node in Node.objects.filter(name__in=names):
        served = ServedModel(node.model, "", node.chat_template, node.n_ctx, node.max_reply_tokens)
        node_heartbeat(name=node.name, capacity=node.capacity, stats={}, incarnation="", served=served)
    return dict(Node.objects.filter(name__in=names).values_list("name", "sessions"))


def test_node_actions_set_the_status_the_router_reads(admin_client, idle_node):
    other = NodeFactory.create(name="other")
    _act(admin_client, "router_node", "drain", idle_node)
    assert Node.objects.get(pk=idle_node.pk).status == Node.Status.DRAINING
    _act(admin_client, "router_node", "mark_down", other)
    assert Node.objects.get(pk=other.pk).status == Node.Status.DOWN
    conversation = ConversationFactory.create()
    with pytest.raises(NoNodeUp):  # neither takes new sessions
        admission.turn_start(conversation=conversation, text="anyone?")
    _act(admin_client, "router_node", "mark_up", idle_node, other)
    assert set(Node.objects.values_list("status", flat=True)) == {Node.Status.UP}
    assert admission.turn_start(conversation=conversation, text="anyone?").node in {"idle", "other"}


def test_deleting_conversations_from_the_list_goes_through_the_deletion_service(admin_client, idle_node):
    doomed = [ConversationFactory.create() for _ in range(2)]
    for conversation in doomed:
        admission.turn_start(conversation=conversation, text="forget me")
    kept = ConversationFactory.create()
    admission.turn_start(conversation=kept, text="keep me")
    admin_client.post(
        reverse("admin:chatapp_conversation_changelist"),
        {"action": "delete_selected", "_selected_action": [c.pk for c in doomed], "post": "yes"},
    )
    assert list(Conversation.objects.all()) == [kept]
    assert list(SessionAssignment.objects.values_list("session_key", flat=True)) == [kept.session_key]
    assert _counted_by_heartbeats("idle") == {"idle": 1}
    assert list(Message.objects.values_list("content", flat=True)) == ["keep me"]
