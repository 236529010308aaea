"""Writes: conversations, turns, and the bridge that runs a turn on a node's engine."""

import logging
import re
from typing import TYPE_CHECKING

from django.conf import settings
from django.contrib.auth.models import User
from django.db import transaction
from django.utils import timezone

from chatapp import streams
from chatapp.models import Conversation, Message, Turn
from chatapp.selectors import history_for_turn
from inference.chat_format import ChatMessage
from router.services import node_for_session, queue_for_node

if TYPE_CHECKING:
    from inference.engine import Engine, Generation

logger = logging.getLogger(__name__)

# C0 control characters other than tab, newline and carriage return; Postgres rejects NUL outright.
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class TurnRejected(ValueError):
    """A message that will not be sent; the text says why, for the person who sent it."""


def check_message_text(text: str) -> str:
    """Return the text as it will be stored, or raise `TurnRejected` saying what is wrong with it."""
    text = _CONTROL_CHARS.sub("", text.encode("utf-8", errors="replace").decode("utf-8")).strip()
    if not text:
        raise TurnRejected("The message is empty.")
    limit = settings.CHAT_MAX_MESSAGE_CHARS
    if len(text) > limit:
        raise TurnRejected(f"The message is {len(text):,} characters; the limit is {limit:,}.")
    return text


def conversation_create(*, owner: User, title: str = "") -> Conversation:
    return Conversation.objects.create(
        owner=owner, title=_CONTROL_CHARS.sub("", title).strip()[:200], strategy=settings.CHAT_DEFAULT_STRATEGY
    )


def turn_start(*, conversation: Conversation, text: str) -> Turn:
    """Store the user's message and its turn in one transaction; enqueue generation once both are durable."""
    text = check_message_text(text)
    with transaction.atomic():
        conversation = Conversation.objects.select_for_update().get(pk=conversation.pk)
        if conversation.turns.exclude(status__in=Turn.FINISHED).exists():
            raise TurnRejected("A reply is still being written; wait for it or stop it first.")
        user_message = Message.objects.create(conversation=conversation, role=Message.Role.USER, content=text)
        node = node_for_session(session_key=str(conversation.pk))
        turn = Turn.objects.create(
            conversation=conversation, user_message=user_message, node=node, strategy=conversation.strategy
        )
        if not conversation.title:
            conversation.title = text.splitlines()[0][:60]
        conversation.save(update_fields=["title", "updated_at"])
        transaction.on_commit(lambda: _dispatch(turn))
    return turn


def _dispatch(turn: Turn) -> None:
    from chatapp.tasks import generate

    generate.apply_async(args=(turn.pk,), queue=queue_for_node(turn.node))


def turn_cancel(*, turn: Turn) -> None:
    """Ask the node to stop this turn's generation at its next token; the partial reply is kept."""
    if not turn.is_finished:
        streams.request_cancel(turn.stream_name)


def turn_generate(*, turn_id: int, engine: "Engine", node: str) -> None:
    """Run one turn on this node's engine and store its reply; idempotent by turn id.

    A turn already finished (a redelivered task) is left alone, and the reply
    is stored at most once.
    """
    turn = _turn_claim(turn_id=turn_id, node=node)
    if turn is None:
        return
    try:
        prompt = engine.chat_format.render(_chat_messages(turn))
        generation = engine.generate(
            session_key=f"conversation:{turn.conversation_id}",
            prompt=prompt,
            sampling=engine.default_sampling(),
            on_text=lambda text: streams.publish(turn.stream_name, {"type": "token", "text": text}),
            should_stop=lambda: streams.cancel_requested(turn.stream_name),
        )
    except Exception as exc:
        logger.exception("turn %s failed on node %s", turn_id, node)
        _turn_fail(turn=turn, error=f"{type(exc).__name__}: {exc}")
        return
    _turn_finish(turn=turn, generation=generation)


def _turn_claim(*, turn_id: int, node: str) -> Turn | None:
    with transaction.atomic():
        turn = Turn.objects.select_for_update().select_related("conversation").get(pk=turn_id)
        if turn.is_finished:
            return None
        turn.status = Turn.Status.RUNNING
        turn.node = node
        turn.started_at = timezone.now()
        turn.queue_ms = (turn.started_at - turn.created_at).total_seconds() * 1000
        turn.save(update_fields=["status", "node", "started_at", "queue_ms"])
    streams.publish(turn.stream_name, {"type": "start", "node": node})
    return turn


def _chat_messages(turn: Turn) -> list[ChatMessage]:
    messages = [ChatMessage(role="system", text=settings.CHAT_SYSTEM_PROMPT)] if settings.CHAT_SYSTEM_PROMPT else []
    for message in history_for_turn(turn):
        token_ids = tuple(message.token_ids) if message.token_ids is not None else None
        messages.append(ChatMessage(role=message.role, text=message.content, token_ids=token_ids))  # type: ignore[arg-type]
    return messages


_FINISH_FIELDS = [
    "assistant_message",
    "status",
    "finish_reason",
    "prompt_tokens",
    "cached_tokens",
    "restored_from_ram",
    "completion_tokens",
    "queue_ms",
    "prefill_ms",
    "ttft_ms",
    "decode_tokens_per_s",
    "finished_at",
]


def _turn_finish(*, turn: Turn, generation: "Generation") -> None:
    with transaction.atomic():
        locked = Turn.objects.select_for_update().get(pk=turn.pk)
        if locked.is_finished:
            return
        reply = None
        if generation.token_ids:  # a reply stopped before its first token leaves no message
            reply = Message.objects.create(
                conversation_id=turn.conversation_id,
                role=Message.Role.ASSISTANT,
                content=generation.text,
                token_ids=generation.token_ids,
            )
        locked.assistant_message = reply
        locked.status = Turn.Status.CANCELLED if generation.finish_reason == "cancelled" else Turn.Status.DONE
        locked.finish_reason = generation.finish_reason
        locked.prompt_tokens = generation.prompt_tokens
        locked.cached_tokens = generation.cached_tokens
        locked.restored_from_ram = generation.restored
        locked.queue_ms = (locked.queue_ms or 0) + generation.queue_ms
        locked.completion_tokens = len(generation.token_ids)
        locked.prefill_ms = generation.prefill_ms
        locked.ttft_ms = generation.ttft_ms
        locked.decode_tokens_per_s = generation.decode_tokens_per_s
        locked.finished_at = timezone.now()
        locked.save(update_fields=_FINISH_FIELDS)
    done = {"type": "done", "status": locked.status, "text": generation.text, "message_id": reply.pk if reply else None}
    streams.publish(turn.stream_name, done)


def _turn_fail(*, turn: Turn, error: str) -> None:
    Turn.objects.filter(pk=turn.pk).exclude(status__in=Turn.FINISHED).update(
        status=Turn.Status.FAILED, error=error[:2000], finished_at=timezone.now()
    )
    streams.publish(turn.stream_name, {"type": "error", "error": error})
