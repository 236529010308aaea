"""One real turn: turn_start -> Celery -> node process -> llama.cpp -> Postgres and Redis."""

import time

import pytest
from django.db import transaction

from chatapp import services, streams
from chatapp.memory.summaries import SUMMARY_TOKENS
from chatapp.models import Message, Summary, Turn
from chatapp.turns import admission, lifecycle
from tests.factories import ConversationFactory, MessageFactory
from tests.helpers import wait_for_turn

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_turn_runs_on_the_node_and_the_next_prompt_contains_it(node, chat_format):
    conversation = ConversationFactory.create()

    first = wait_for_turn(admission.turn_start(conversation=conversation, text="Hello! What is your favourite fruit?"))
    assert first.status == Turn.Status.DONE, first.error
    reply = first.assistant_message
    assert reply is not None and reply.content.strip()
    assert reply.token_ids and len(reply.token_ids) == first.completion_tokens
    assert first.node == node
    assert first.prompt_tokens and first.prompt_tokens > 10
    assert first.ttft_ms and first.ttft_ms > 0
    assert first.queue_ms is not None and first.queue_ms >= 0
    # The turn records what its strategy resent, and it is exactly what the node prefilled or reused.
    assert first.strategy == "stable_prefix" and first.strategy_options
    assert first.trace["kept"] == [first.user_message_id] and first.trace["dropped"] == []
    assert first.trace["tokens"] + chat_format.overhead == first.prompt_tokens  # + the template's own tokens
    assert len(first.prompt_hash) == 32
    events = streams.read_all(first.stream_name)
    assert [e["type"] for e in (events[0], events[-1])] == ["start", "done"]
    assert "".join(e["text"] for e in events if e["type"] == "token").strip() == reply.content.strip()

    second = wait_for_turn(admission.turn_start(conversation=conversation, text="Why that one?"))
    assert second.status == Turn.Status.DONE, second.error
    # The second prompt starts with the first prompt and reply, token for token: the node reused it.
    reused_at_least = first.prompt_tokens + first.completion_tokens - 1
    assert second.cached_tokens is not None and second.cached_tokens >= reused_at_least
    assert second.prompt_tokens is not None and second.prompt_tokens > first.prompt_tokens + first.completion_tokens
    assert second.trace["kept"] == [first.user_message_id, reply.pk, second.user_message_id]


def test_a_failing_generation_marks_the_turn_failed_and_keeps_the_message(node):
    conversation = ConversationFactory.create(strategy="full")
    # A history longer than the node's 4,096-token context: `full` refuses to drop any of it, and says so.
    for i in range(4):
        MessageFactory.create(conversation=conversation, content=" ".join(f"word{i}{j}" for j in range(700)))
    turn = wait_for_turn(admission.turn_start(conversation=conversation, text="Still there?"))
    assert turn.status == Turn.Status.FAILED
    assert "ContextOverflow" in turn.error and "fit in the model's context" in turn.error
    assert turn.assistant_message is None
    assert Message.objects.filter(pk=turn.user_message_id, content="Still there?").exists()
    assert streams.read_all(turn.stream_name)[-1]["type"] == "error"


def test_a_reply_cancelled_before_it_starts_stores_no_message(node):
    conversation = ConversationFactory.create()
    with transaction.atomic():  # the cancel is recorded before the node can see the turn
        turn = admission.turn_start(conversation=conversation, text="Tell me a long story about the sea.")
        lifecycle.turn_cancel(turn=turn)  # still queued: cancelled at once, and the node's claim is refused
    turn = wait_for_turn(turn)
    assert turn.status == Turn.Status.CANCELLED
    assert turn.finish_reason == "cancelled"
    assert not turn.completion_tokens and turn.started_at is None  # never ran: no empty reply is stored
    assert turn.assistant_message is None
    assert Message.objects.filter(pk=turn.user_message_id).exists()


def test_a_redelivered_task_does_not_store_a_second_reply(node):
    from chatapp.tasks import generate
    from router.services import queue_for_node

    conversation = ConversationFactory.create()
    turn = wait_for_turn(admission.turn_start(conversation=conversation, text="Hi"))
    generate.apply_async(args=(turn.pk,), queue=queue_for_node(node))
    follow_up = wait_for_turn(admission.turn_start(conversation=conversation, text="Hello again"))
    assert follow_up.status == Turn.Status.DONE
    assert conversation.messages.filter(role=Message.Role.ASSISTANT).count() == 2


def test_a_failed_turn_can_be_retried_and_then_succeeds(node):
    conversation = ConversationFactory.create(strategy="full")
    big = MessageFactory.create(conversation=conversation, content=" ".join(f"w{j}" for j in range(3000)))
    turn = wait_for_turn(admission.turn_start(conversation=conversation, text="Hello?"))
    assert turn.status == Turn.Status.FAILED
    services.message_set_flags(message=big, excluded=True)  # the user drops the culprit from the prompt
    lifecycle.turn_retry(turn=turn)
    turn = wait_for_turn(turn)
    assert turn.status == Turn.Status.DONE and turn.attempt == 1 and turn.error == ""
    assert conversation.messages.filter(role=Message.Role.USER, content="Hello?").count() == 1


def test_a_long_conversation_switched_to_summary_keeps_answering(node):
    conversation = ConversationFactory.create()
    for i in range(60):  # about 4,800 tokens: more than the node's whole 4,096-token context
        role = Message.Role.USER if i % 2 == 0 else Message.Role.ASSISTANT
        content = f"Day {i}: we walked along the river to the old mill, talked about books and ate apples. " * 4
        MessageFactory.create(conversation=conversation, role=role, content=content)
    services.conversation_set_strategy(conversation=conversation, strategy="summary")

    first = wait_for_turn(admission.turn_start(conversation=conversation, text="What did we talk about?"))
    assert first.status == Turn.Status.DONE, first.error
    # After the reply, the node summarises what the prompt dropped, in chunks that each fit its context.
    last_dropped = max(first.trace["dropped"])
    deadline = time.monotonic() + 240
    while not Summary.objects.filter(conversation=conversation, through_message_id=last_dropped).exists():
        assert time.monotonic() < deadline, "the node wrote no summary of the dropped turns"
        time.sleep(0.5)
    summaries = list(Summary.objects.filter(conversation=conversation))
    assert len(summaries) > 1 and all(s.prompt_tokens + SUMMARY_TOKENS <= 4096 for s in summaries)

    second = wait_for_turn(admission.turn_start(conversation=conversation, text="And what did we eat?"))
    assert second.status == Turn.Status.DONE, second.error
    assert "summary" in [segment["kind"] for segment in second.trace["segments"]]
    assert set(first.trace["dropped"]) <= set(second.trace["summarized"])
