"""Writes: conversations, turns, and the bridge that runs a turn on a node's engine."""

import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from chatapp import streams
from chatapp.memory.registry import strategy_aliases, strategy_get
from chatapp.models import Conversation, Message, Turn, UserFact
from inference.chat_format import ChatMessage
from inference.config import EngineConfig
from inference.tokenizer import chat_format_for
from router.services import NoHealthyNode, queue_for_node, session_node

logger = logging.getLogger(__name__)

# C0 control characters other than tab, newline and carriage return; Postgres rejects NUL outright.
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class TurnRejected(ValueError):
    """A message that will not be sent; the text says why, for the person who sent it."""


class NodeBusy(TurnRejected):
    """The session's node has a full queue: try again in `retry_after` seconds (nothing was stored)."""

    status = 429
    retry_after = 2


class NoNodeUp(TurnRejected):
    """No inference node is healthy (all restarting, say): try again in `retry_after` seconds."""

    status = 503
    retry_after = 5


def without_control_characters(text: str) -> str:
    """The text with C0 controls (but tab and newlines) removed and unencodable characters replaced."""
    return _CONTROL_CHARS.sub("", text.encode("utf-8", errors="replace").decode("utf-8"))


def check_message_text(text: str) -> str:
    """Return the text as it will be stored, or raise `TurnRejected` saying what is wrong with it."""
    text = without_control_characters(text).strip()
    if not text:
        raise TurnRejected("The message is empty.")
    limit = settings.CHAT_MAX_MESSAGE_CHARS
    if len(text) > limit:
        raise TurnRejected(f"The message is {len(text):,} characters; the limit is {limit:,}.")
    return text


def check_message_fits(text: str) -> None:
    """Refuse, before storing it, a message that alone cannot fit the context with room for the reply."""
    config = EngineConfig()
    fmt = chat_format_for(config.MODEL_PATH)
    tokens = fmt.count([ChatMessage("user", text)])
    if tokens + fmt.overhead + config.MAX_REPLY_TOKENS > config.N_CTX:
        raise TurnRejected(
            f"The message is {tokens:,} tokens; with room for a reply it does not fit the model's "
            f"{config.N_CTX:,}-token context. Shorten it or send it in parts."
        )


def check_strategy(alias: str, options: dict | None = None) -> str:
    """The alias, if it names a configured strategy that builds with `options`; else ValueError saying why."""
    if alias not in strategy_aliases():
        raise ValueError(f"Unknown memory strategy {alias!r}; choose one of: {', '.join(strategy_aliases())}.")
    if options:
        try:
            strategy_get(alias, options)
        except ImproperlyConfigured as exc:
            raise ValueError(str(exc)) from exc
    return alias


def conversation_create(
    *, owner: User, title: str = "", strategy: str = "", strategy_options: dict | None = None
) -> Conversation:
    return Conversation.objects.create(
        owner=owner,
        title=without_control_characters(title).strip()[:200],
        strategy=check_strategy(strategy or settings.CHAT_DEFAULT_STRATEGY, strategy_options),
        strategy_options=strategy_options or {},
    )


@dataclass(frozen=True)
class ImportedMessage:
    role: str  # "user" or "assistant"
    text: str
    sent_at: datetime


def conversation_import(
    *,
    owner: User,
    title: str,
    messages: Sequence[ImportedMessage],
    user_name: str = "User",
    assistant_name: str = "Assistant",
    strategy: str = "",
) -> Conversation:
    """Store a whole conversation said elsewhere, with its own times and speakers' names, in one transaction.
    Every message is checked like a typed one; nothing is stored if one is refused (TurnRejected says which)."""
    rows = []
    for number, message in enumerate(messages, start=1):
        if message.role not in (Message.Role.USER, Message.Role.ASSISTANT):
            raise TurnRejected(f"Message {number}: the role must be user or assistant, not {message.role!r}.")
        try:
            text = check_message_text(message.text)
        except TurnRejected as exc:
            raise TurnRejected(f"Message {number}: {exc}") from exc
        rows.append(Message(role=message.role, content=text, created_at=message.sent_at))
    with transaction.atomic():
        conversation = conversation_create(owner=owner, title=title, strategy=strategy)
        conversation.user_name = without_control_characters(user_name).strip()[:100] or "User"
        conversation.assistant_name = without_control_characters(assistant_name).strip()[:100] or "Assistant"
        conversation.save(update_fields=["user_name", "assistant_name"])
        for row in rows:
            row.conversation = conversation
        Message.objects.bulk_create(rows)
    return conversation


def conversation_set_strategy(*, conversation: Conversation, strategy: str) -> None:
    """Switch how future turns are assembled (with the alias's own options); turns already run keep theirs."""
    conversation.strategy = check_strategy(strategy)
    conversation.strategy_options = {}
    conversation.save(update_fields=["strategy", "strategy_options", "updated_at"])


def message_set_flags(*, message: Message, pinned: bool | None = None, excluded: bool | None = None) -> None:
    fields = []
    if pinned is not None:
        message.pinned = pinned
        fields.append("pinned")
    if excluded is not None:
        message.excluded = excluded
        fields.append("excluded")
    message.save(update_fields=fields)


def fact_save(*, owner: User, text: str, fact: UserFact | None = None) -> UserFact:
    """Add a fact, or change `fact`'s text; the text is checked like a message."""
    text = check_message_text(text)[:500]
    if fact is None:
        return UserFact.objects.create(owner=owner, text=text)
    fact.text = text
    fact.save(update_fields=["text"])
    return fact


def fact_delete(*, fact: UserFact) -> None:
    fact.delete()


_REMEMBER = re.compile(r"^\s*remember that\s+(?P<fact>.+)", re.IGNORECASE | re.DOTALL)


def turn_start(
    *, conversation: Conversation, text: str, sampling: dict | None = None, policy: str | None = None
) -> Turn:
    """Store the user's message and its turn in one transaction; enqueue generation once both are durable.

    `sampling` overrides the node's defaults (fields of inference.engine.Sampling); `policy` is a routing
    policy alias other than the default (a replay comparing policies).
    """
    text = check_message_text(text)
    check_message_fits(text)
    with transaction.atomic():
        conversation = Conversation.objects.select_for_update().get(pk=conversation.pk)
        if conversation.turns.exclude(status__in=Turn.FINISHED).exists():
            raise TurnRejected("A reply is still being written; wait for it or stop it first.")
        try:
            node = session_node(session_key=session_key_for(conversation), policy=policy)
        except NoHealthyNode as exc:
            raise NoNodeUp(str(exc)) from exc
        unfinished = Turn.objects.filter(node=node.name).exclude(status__in=Turn.FINISHED).count()
        if unfinished >= node.capacity * settings.CHAT_QUEUE_PER_SLOT:
            raise NodeBusy(f"The model is busy ({unfinished} replies queued); try again in a few seconds.")
        user_message = Message.objects.create(conversation=conversation, role=Message.Role.USER, content=text)
        turn = Turn.objects.create(
            conversation=conversation,
            user_message=user_message,
            node=node.name,
            strategy=conversation.strategy,
            strategy_options=conversation.strategy_options,
            sampling=sampling or {},
        )
        if remembered := _REMEMBER.match(text):  # "remember that ..." also saves a fact
            fact_save(owner=conversation.owner, text=remembered["fact"])
        if not conversation.title:
            conversation.title = text.splitlines()[0][:60]
        conversation.save(update_fields=["title", "updated_at"])
        transaction.on_commit(lambda: _dispatch(turn))
    return turn


def session_key_for(conversation: Conversation) -> str:
    """The router's and the engine's name for a conversation."""
    return f"conversation:{conversation.pk}"


def _dispatch(turn: Turn) -> None:
    """Queue the turn's task on its node. The turn is already stored: if the broker is unreachable, the
    node finds the turn by its age (`turns_resend_lost`) once the broker is back."""
    from chatapp.tasks import generate

    try:
        generate.apply_async(args=(turn.pk, turn.attempt), queue=queue_for_node(turn.node))
    except (KombuError, RedisError, OSError) as exc:
        logger.warning("turn %s not queued yet (%s); its node will pick it up", turn.pk, exc)


def turns_redispatch(*, from_nodes: list[str]) -> int:
    """Send the unfinished turns of dead nodes to healthy ones (a new attempt each); the number moved."""
    unfinished = Turn.objects.filter(node__in=from_nodes).exclude(status__in=Turn.FINISHED)
    return _resend(unfinished, still=lambda turn: not turn.is_finished and turn.node in from_nodes)


def turns_resend_lost(*, node: str, older_than_s: float) -> int:
    """Send again the turns queued on `node` longer than `older_than_s` while it is idle: their task is gone
    (the broker restarted without persistence, or was down when the turn was stored). A late original
    task for an older attempt does nothing."""
    cutoff = timezone.now() - timedelta(seconds=older_than_s)
    lost = Turn.objects.filter(node=node, status=Turn.Status.QUEUED, queued_at__lt=cutoff)
    return _resend(lost, still=lambda turn: turn.status == Turn.Status.QUEUED and turn.queued_at < cutoff)


def _resend(turns: QuerySet[Turn], *, still: Callable[[Turn], bool]) -> int:
    """Route each turn again and queue it as a new attempt, if `still` holds for it under its row lock."""
    sent = 0
    for turn_id in turns.values_list("pk", flat=True):
        with transaction.atomic():
            turn = Turn.objects.select_for_update().select_related("conversation").get(pk=turn_id)
            if not still(turn):
                continue
            try:
                node = session_node(session_key=session_key_for(turn.conversation))
            except NoHealthyNode:
                logger.warning("turn %s stays on node %s: no healthy node", turn.pk, turn.node)
                continue
            turn.node, turn.status, turn.queued_at = node.name, Turn.Status.QUEUED, timezone.now()
            turn.attempt += 1
            turn.save(update_fields=["node", "attempt", "status", "queued_at"])
            transaction.on_commit(lambda turn=turn: _dispatch(turn))  # type: ignore[misc]
            sent += 1
    return sent


def turn_cancel(*, turn: Turn) -> None:
    """Ask the node to stop this turn's generation at its next token; the partial reply is kept."""
    if not turn.is_finished:
        streams.request_cancel(turn.stream_name)


def turn_retry(*, turn: Turn) -> None:
    """Send a failed turn again, to its session's node, as a new attempt; its user message stays as it was."""
    with transaction.atomic():
        turn = Turn.objects.select_for_update().select_related("conversation").get(pk=turn.pk)
        if turn.status != Turn.Status.FAILED:
            raise TurnRejected("Only a failed reply can be retried.")
        try:
            node = session_node(session_key=session_key_for(turn.conversation))
        except NoHealthyNode as exc:
            raise NoNodeUp(str(exc)) from exc
        turn.node, turn.status, turn.error, turn.finished_at = node.name, Turn.Status.QUEUED, "", None
        turn.attempt += 1
        turn.queued_at = timezone.now()
        turn.save(update_fields=["node", "status", "error", "finished_at", "attempt", "queued_at"])
        transaction.on_commit(lambda: _dispatch(turn))
