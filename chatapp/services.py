"""Writes: conversations, their settings, message flags and facts. A turn's own writes live in
`chatapp.turns` (admission to start one, lifecycle for everything after)."""

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

from django.conf import settings
from django.contrib.auth.models import User
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from chatapp import quotas
from chatapp.memory.registry import strategy_aliases, strategy_get
from chatapp.models import Conversation, Message, Turn, UserFact
from chatapp.turns.lifecycle import turn_cancel
from chatapp.validation import TurnRejected, check_message_text, without_control_characters
from inference.model_files import PACKAGED
from router.services import assignment_end, known_models, queue_for_node

logger = logging.getLogger(__name__)


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


class UnknownModel(ValueError):
    pass


def check_model(model: str) -> str:
    """The model, if it is packaged here or some node has registered it (up or not); else UnknownModel."""
    if model in PACKAGED:  # most requests: no query
        return model
    known = set(PACKAGED) | known_models()
    if model not in known:
        raise UnknownModel(f"The model `{model}` does not exist; models: {', '.join(sorted(known))}.")
    return model


TITLE_CHARS = 200


def conversation_create(
    *, owner: User, title: str = "", strategy: str = "", strategy_options: dict | None = None, model: str = ""
) -> Conversation:
    quotas.check_can_add_conversation(user_id=owner.pk)
    return Conversation.objects.create(
        owner=owner,
        title=without_control_characters(title).strip()[:TITLE_CHARS],
        strategy=check_strategy(strategy or settings.CHAT_DEFAULT_STRATEGY, strategy_options),
        strategy_options=strategy_options or {},
        model=check_model(model or settings.CHAT_DEFAULT_MODEL),
    )


def conversation_delete(*, conversation: Conversation) -> None:
    """Delete a conversation with its messages, turns and summaries. A reply being written stops; the
    router forgets its session, and the node it was on drops the session's cached state (context, RAM and
    disk tier) once the deletion is committed."""
    for turn in conversation.turns.exclude(status__in=Turn.FINISHED):
        turn_cancel(turn=turn)
    key = conversation.session_key
    with transaction.atomic():
        node = assignment_end(session_key=key)
        conversation.delete()
        if node is not None:
            transaction.on_commit(lambda: _end_sessions_on(node, [key, f"{key}:summary"]))


def _end_sessions_on(node: str, session_keys: list[str]) -> None:
    from chatapp.tasks import end_sessions  # the tasks module imports the node side

    try:
        end_sessions.apply_async(args=(session_keys,), queue=queue_for_node(node))
    except (KombuError, RedisError, OSError) as exc:  # broker down: the node's caches evict the state in time
        logger.warning("node %s not told to end sessions %s (%s)", node, session_keys, exc)


def conversation_set_model(*, conversation: Conversation, model: str) -> None:
    """Answer future turns with another model. Its nodes re-tokenize the earlier replies (another
    vocabulary), so the first turn after a switch computes the whole prompt."""
    if conversation.model != model:
        conversation.model = check_model(model)
        conversation.save(update_fields=["model", "updated_at"])


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
    system_prompt: str = "",
) -> Conversation:
    """Store a whole conversation said elsewhere, with its own times and speakers' names, in one transaction.
    Every message is checked like a typed one; nothing is stored if one is refused (TurnRejected says which)."""
    system_prompt = check_system_prompt(system_prompt)
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
        conversation.system_prompt = system_prompt
        conversation.save(update_fields=["user_name", "assistant_name", "system_prompt"])
        for row in rows:
            row.conversation = conversation
        Message.objects.bulk_create(rows)
    return conversation


def conversation_rename(*, conversation: Conversation, title: str) -> None:
    title = without_control_characters(title).strip()
    if len(title) > TITLE_CHARS:
        raise TurnRejected(f"The title is {len(title):,} characters; the limit is {TITLE_CHARS}.")
    conversation.title = title
    conversation.save(update_fields=["title", "updated_at"])


def check_system_prompt(text: str) -> str:
    """The system prompt as it will be stored ("": the default), or TurnRejected saying why not."""
    text = without_control_characters(text).strip()
    limit = settings.CHAT_MAX_MESSAGE_CHARS
    if len(text) > limit:
        raise TurnRejected(f"The system prompt is {len(text):,} characters; the limit is {limit:,}.")
    return text


def conversation_set_system_prompt(*, conversation: Conversation, system_prompt: str) -> None:
    """Set the conversation's own system prompt ("": the default). It leads every prompt, so the next turn
    computes its prompt afresh."""
    conversation.system_prompt = check_system_prompt(system_prompt)
    conversation.save(update_fields=["system_prompt", "updated_at"])


def conversation_set_strategy(*, conversation: Conversation, strategy: str) -> None:
    """Switch how future turns are assembled (with the alias's own options); turns already run keep theirs."""
    conversation.strategy = check_strategy(strategy)
    conversation.strategy_options = {}
    conversation.save(update_fields=["strategy", "strategy_options", "updated_at"])


def message_set_flags(*, message: Message, pinned: bool | None = None, excluded: bool | None = None) -> None:
    fields = []
    if pinned and not message.pinned:
        quotas.check_can_pin(conversation_id=message.conversation_id)
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
        quotas.check_can_add_fact(user_id=owner.pk)
        return UserFact.objects.create(owner=owner, text=text)
    fact.text = text
    fact.save(update_fields=["text"])
    return fact


def fact_delete(*, fact: UserFact) -> None:
    fact.delete()
