"""A turn's transitions, each under its row lock and its attempt (Postgres and Redis, no node needed)."""

import uuid

import pytest
from django.db import connection
from django.db.models import Q

from chatapp import quotas, services, streams
from chatapp.models import Message, Turn
from chatapp.turns import admission, lifecycle
from chatapp.turns.recovery import turns_reap
from chatapp.validation import NoNodeUp, QuotaExceeded, ReplyInProgress, TurnRejected
from router.models import Node
from tests.factories import ConversationFactory, MessageFactory, NodeFactory
from tests.helpers import generation


def running_turn(idle_node, *, incarnation: str = "a") -> Turn:
    turn = admission.turn_start(conversation=ConversationFactory.create(), text="hello")
    claimed = lifecycle.turn_claim(turn_id=turn.pk, attempt=0, node=idle_node.name, incarnation=incarnation)
    assert claimed is not None and claimed.status == Turn.Status.RUNNING
    return claimed


def test_the_declared_transitions_are_the_only_ones():
    finished = {s for s, targets in lifecycle.ALLOWED.items() if not targets}
    assert finished == set(Turn.FINISHED) - {Turn.Status.FAILED}
    assert lifecycle.ALLOWED[Turn.Status.FAILED] == {Turn.Status.QUEUED}  # retry, as a new attempt


def test_a_stale_attempt_writes_nothing_to_postgres(db, idle_node):
    stale = running_turn(idle_node)
    assert lifecycle.turn_resend(turn_id=stale.pk, attempt=0, why="its node was lost") is True  # attempt 1
    assert lifecycle.turn_claim(turn_id=stale.pk, attempt=0, node="old", incarnation="a") is None
    assert not lifecycle.turn_record_prompt(turn=stale, fields={"prompt_text": "stale"})
    assert lifecycle.turn_finish(turn=stale, generation=generation("stale reply")) is None
    assert not lifecycle.turn_fail(turn_id=stale.pk, attempt=0, error="stale failure")
    turn = Turn.objects.get(pk=stale.pk)
    assert (turn.status, turn.attempt, turn.prompt_text, turn.error) == (Turn.Status.QUEUED, 1, "", "")
    assert not Message.objects.filter(role="assistant").exists()
    [earlier] = turn.earlier_attempts  # the attempt history keeps the one that was cut short
    assert (earlier["attempt"], earlier["node"], earlier["status"]) == (0, idle_node.name, Turn.Status.RUNNING)
    assert (earlier["incarnation"], earlier["why"]) == (stale.node_incarnation, "its node was lost")
    assert earlier["started_at"] and earlier["ended_at"] >= earlier["started_at"]

    current = lifecycle.turn_claim(turn_id=turn.pk, attempt=1, node=idle_node.name, incarnation="b")
    assert current is not None
    finished = lifecycle.turn_finish(turn=current, generation=generation())
    assert finished is not None and finished.status == Turn.Status.DONE
    assert lifecycle.turn_finish(turn=current, generation=generation("again")) is None  # stored once
    assert list(Message.objects.filter(role="assistant").values_list("content", flat=True)) == ["Hi there."]


def test_a_reply_finishing_after_its_turn_ended_or_was_deleted_stores_nothing(db, idle_node):
    failed = running_turn(idle_node)
    assert lifecycle.turn_fail(turn_id=failed.pk, attempt=0, error="its node was lost")
    assert lifecycle.turn_finish(turn=failed, generation=generation("late reply")) is None
    assert Turn.objects.get(pk=failed.pk).status == Turn.Status.FAILED
    assert failed.status == Turn.Status.RUNNING and failed.assistant_message is None  # the caller's copy too

    deleted = running_turn(idle_node)
    deleted.conversation.delete()
    assert lifecycle.turn_finish(turn=deleted, generation=generation("orphan reply")) is None
    assert not Message.objects.filter(role="assistant").exists()  # each reply's insert was rolled back


def test_a_stale_attempt_writes_nothing_to_the_stream():
    key = f"test-{uuid.uuid4().hex}"
    assert streams.publish(key, {"type": "token", "text": "old "}, attempt=0)
    streams.fence(key, 1)  # the turn was sent again
    assert not streams.publish(key, {"type": "token", "text": "stale"}, attempt=0)
    assert streams.publish(key, {"type": "start", "node": "b"}, attempt=1)
    streams.fence(key, 0)  # a fence never goes back
    assert not streams.publish(key, {"type": "token", "text": "stale"}, attempt=0)
    assert [(e["type"], e["attempt"]) for e in streams.read_all(key)] == [("token", 0), ("start", 1)]


def test_an_append_says_whether_the_reader_asked_the_turn_to_stop():
    key = f"test-{uuid.uuid4().hex}"
    assert streams.publish(key, {"type": "token", "text": "a"}, attempt=0) is streams.Appended.WRITTEN
    streams.request_cancel(key)
    assert streams.publish(key, {"type": "token", "text": "b"}, attempt=0) is streams.Appended.STOP_ASKED
    streams.fence(key, 1)
    assert streams.publish(key, {"type": "token", "text": "c"}, attempt=0) is streams.Appended.SUPERSEDED
    assert [e["text"] for e in streams.read_all(key)] == ["a", "b"]


def test_retry_keeps_one_reply_at_a_time(db, idle_node):
    turn = running_turn(idle_node)
    assert lifecycle.turn_fail(turn_id=turn.pk, attempt=0, error="boom")
    later = admission.turn_start(conversation=turn.conversation, text="next")  # a later message, still running
    with pytest.raises(ReplyInProgress):
        lifecycle.turn_retry(turn=turn)
    lifecycle.turn_cancel(turn=later)  # queued: cancelled at once
    assert Turn.objects.get(pk=later.pk).status == Turn.Status.CANCELLED
    with pytest.raises(TurnRejected, match="latest reply"):
        lifecycle.turn_retry(turn=turn)
    assert Turn.objects.get(pk=turn.pk).status == Turn.Status.FAILED


def test_the_unfinished_turns_are_found_through_their_own_index(db, idle_node):
    """A node's queue, a user's replies in progress and the orphans are read among the unfinished turns
    only, never by scanning every turn a node or a user ever had."""
    (index,) = Turn._meta.indexes
    assert index.condition == ~Q(status__in=Turn.FINISHED)
    unfinished = Turn.objects.exclude(status__in=Turn.FINISHED)
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a test's few rows: ask what the index can serve
    assert "turn_unfinished_by_node" in unfinished.filter(node=idle_node.name).explain()
    mine = unfinished.filter(Q(conversation__owner_id=1) | Q(api_key_id=1))  # as the fair-use check asks
    assert "turn_unfinished_by_node" in mine.explain()


def test_a_turn_held_by_a_replaced_incarnation_is_sent_again(db, idle_node):
    turn = running_turn(idle_node, incarnation="before-restart")
    Node.objects.filter(pk=idle_node.pk).update(incarnation="after-restart")
    assert turns_reap() == 1
    turn.refresh_from_db()
    assert (turn.status, turn.attempt, turn.node_incarnation) == (Turn.Status.QUEUED, 1, "")


def test_a_turn_on_a_dead_node_fails_clearly_once_no_node_has_come_back(db, idle_node, settings):
    turn = running_turn(idle_node)
    Node.objects.update(status=Node.Status.DOWN)
    settings.CHAT_ORPHAN_SECONDS = 3600
    assert turns_reap() == 0  # no node to take it: it waits
    assert Turn.objects.get(pk=turn.pk).status == Turn.Status.RUNNING
    settings.CHAT_ORPHAN_SECONDS = 0
    assert turns_reap() == 1
    turn.refresh_from_db()
    assert turn.status == Turn.Status.FAILED and "No inference node" in turn.error


def test_a_conversation_is_never_blocked_by_a_turn_no_node_will_finish(db, idle_node, settings):
    turn = running_turn(idle_node)
    spare = NodeFactory.create(name="spare")
    Node.objects.filter(pk=idle_node.pk).update(status=Node.Status.DOWN)
    with pytest.raises(ReplyInProgress):  # its node is down: it went on to the spare node, and is written there
        admission.turn_start(conversation=turn.conversation, text="hello again")
    turn.refresh_from_db()
    assert (turn.node, turn.attempt, turn.status) == (spare.name, 1, Turn.Status.QUEUED)

    Node.objects.update(status=Node.Status.DOWN)  # now no node is up at all
    settings.CHAT_ORPHAN_SECONDS = 0
    with pytest.raises(NoNodeUp):  # a 503 saying so, not "a reply is still being written"
        admission.turn_start(conversation=turn.conversation, text="hello again")
    turn.refresh_from_db()
    assert turn.status == Turn.Status.FAILED and "No inference node" in turn.error


def test_fair_use_limits_per_user(db, idle_node, settings):
    settings.CHAT_USER_MAX_RUNNING_TURNS = 2
    owner = ConversationFactory.create().owner
    for _ in range(2):
        admission.turn_start(conversation=ConversationFactory.create(owner=owner), text="hi")
    with pytest.raises(QuotaExceeded, match="limit is 2") as refused:
        admission.turn_start(conversation=ConversationFactory.create(owner=owner), text="hi")
    assert refused.value.retry_after and refused.value.status == 429
    admission.turn_start(conversation=ConversationFactory.create(), text="someone else is served")
    quotas.grant_unlimited_use(owner)
    admission.turn_start(conversation=ConversationFactory.create(owner=owner), text="the replay's account")


def test_tokens_per_minute_are_shared_and_answered_with_retry_after(db, idle_node, settings):
    settings.CHAT_USER_TOKENS_PER_MINUTE = 1000
    conversation = ConversationFactory.create()
    for key in streams.client().scan_iter(f"quota:tokens:user:{conversation.owner_id}:*"):  # ids restart each run
        streams.client().delete(key)
    quotas.charge_tokens(user_id=conversation.owner_id, tokens=1000)
    with pytest.raises(QuotaExceeded, match="used 1,000 tokens this minute; the limit is 1,000") as refused:
        admission.turn_start(conversation=conversation, text="hi")
    assert refused.value.retry_after is not None and 0 < refused.value.retry_after <= 61
    assert not Message.objects.exists()


def test_caps_on_facts_pins_and_conversations(db, settings):
    settings.CHAT_USER_MAX_FACTS, settings.CHAT_MAX_PINS_PER_CONVERSATION = 1, 1
    settings.CHAT_USER_MAX_CONVERSATIONS = 1
    conversation = ConversationFactory.create()
    services.fact_save(owner=conversation.owner, text="I like tea.")
    with pytest.raises(TurnRejected, match="1 saved facts"):
        services.fact_save(owner=conversation.owner, text="I like coffee.")
    first, second = MessageFactory.create_batch(2, conversation=conversation)
    services.message_set_flags(message=first, pinned=True)
    with pytest.raises(TurnRejected, match="1 pinned messages"):
        services.message_set_flags(message=second, pinned=True)
    with pytest.raises(TurnRejected, match="1 conversations"):
        services.conversation_create(owner=conversation.owner)
