"""Whether a new turn may start, and starting it: every check first, then one transaction that stores the
user's message and the queued turn. A refused turn stores nothing."""

import re
from collections.abc import Callable
from dataclasses import replace
from functools import cache, partial
from typing import NamedTuple

from django.conf import settings
from django.db import transaction
from django.db.models import QuerySet

from chatapp import quotas
from chatapp.memory.registry import strategy_get, strategy_options
from chatapp.models import ApiKey, Conversation, Message, Turn
from chatapp.services import fact_save
from chatapp.turns.lifecycle import turn_create
from chatapp.turns.recovery import turns_reap
from chatapp.validation import ContextTooSmall, NodeBusy, NoNodeUp, ReplyInProgress, check_message_text
from inference.chat_format import ChatFormat
from inference.chat_templates import ChatMessage
from inference.model_files import ModelNotFound, resolve_model
from inference.tokenizer import chat_format_for
from router.services import NoHealthyNode, ServedModel, served_model, session_node

_REMEMBER = re.compile(r"^\s*remember that\s+(?P<fact>.+)", re.IGNORECASE | re.DOTALL)


def check_message_fits(text: str, *, model: str) -> ServedModel:
    """Refuse a message that alone cannot fit the context of `model`'s nodes with room for the reply,
    counted with that model's vocabulary and template; refuse a model no node serves now. Returns what
    its nodes serve."""
    served = served_model(model)
    if served is None:
        raise NoNodeUp(f"No inference node serves the model {model}; try again shortly.")
    fmt = served_chat_format(served)
    tokens = fmt.count([ChatMessage("user", text)])
    if tokens + fmt.overhead + served.max_reply_tokens > served.n_ctx:
        raise ContextTooSmall(
            f"The message is {tokens:,} tokens; with room for a reply it does not fit the model's "
            f"{served.n_ctx:,}-token context ({model}). Shorten it or send it in parts."
        )
    return served


def served_chat_format(served: ServedModel) -> ChatFormat:
    """The vocabulary and template the nodes of a model use: the packaged model of that name installed here,
    or the file the nodes registered, when this machine has it too."""
    return _served_format(served.model, served.model_path, served.chat_template)


@cache
def _served_format(model: str, model_path: str, chat_template: str) -> ChatFormat:
    """Once per process and served file, as the vocabulary itself: finding a packaged model's file reads
    its package's metadata, a millisecond of every turn. A file not found is not kept: the next turn looks
    again."""
    try:
        file = resolve_model(name=model)
    except ModelNotFound:
        try:
            file = resolve_model(name=model, path=model_path)
        except ModelNotFound as exc:
            raise NoNodeUp(f"This web process cannot read the vocabulary of the model {model}: {exc}") from exc
    return chat_format_for(replace(file, chat_template=chat_template))


class RouteHints(NamedTuple):
    """What the web knows of a turn's session that its router cannot see (`session_node`'s hints)."""

    new: bool  # no finished turn yet: most likely no node yet either
    cold: bool  # the prompt will not extend the previous one: its node's cache is no use to it


def latest_turn(conversation: Conversation) -> Turn | None:
    """The conversation's latest turn, with what starting the next one asks of it: whether it is finished
    (only the latest turn can be unfinished: a turn starts, or a failed one is retried, only while none is),
    the request it answered (a request sent again) and how its prompt was made (`route_hints`)."""
    return conversation.turns.select_related("user_message").defer(*Turn.PROMPT_RECORD).order_by("-pk").first()


def route_hints(conversation: Conversation, served: ServedModel, latest: Turn | None) -> RouteHints:
    """Whether the session is new, and whether the next turn's prompt will not extend the previous turn's
    prompt and reply: the strategy changed since, or the strategy says its history is due for a chunked
    drop (from the previous prompt's verbatim tokens and its reply). The router may then move the session
    for free. A forecast from stored sizes: a wrong one costs at most one move (or one read, for `new`).
    `latest`: the conversation's latest turn (`latest_turn`), finished; the previous turn is the latest
    one that is done."""
    previous = latest
    if latest is not None and latest.status != Turn.Status.DONE:
        done = conversation.turns.filter(status=Turn.Status.DONE).order_by("-pk")
        previous = done.only("strategy", "strategy_options", "trace", "completion_tokens").first()
    if previous is None:
        return RouteHints(new=True, cold=False)
    if not _same_strategy(previous, conversation):
        return RouteHints(new=False, cold=True)
    verbatim = sum(s["tokens"] for s in previous.trace.get("segments", ()) if s["kind"] == "verbatim")
    strategy = strategy_get(conversation.strategy, conversation.strategy_options)
    history = verbatim + (previous.completion_tokens or 0)
    return RouteHints(
        new=False, cold=strategy.breaks_prefix(history_tokens=history, budget=served.n_ctx - served.max_reply_tokens)
    )


def _same_strategy(turn: Turn, conversation: Conversation) -> bool:
    """Whether the turn's prompt was made by the strategy the conversation has now, with the same options.
    A turn records its options as its prompt used them (the alias's, with the conversation's overrides over
    them); the conversation keeps only its overrides. So both are compared resolved."""
    if turn.strategy != conversation.strategy:
        return False
    used = strategy_options(turn.strategy, turn.strategy_options)
    return used == strategy_options(conversation.strategy, conversation.strategy_options)


class UnfinishedTurn(Exception):
    """A turn start met an unfinished turn before orphans were sent on (`reaping_first`)."""


class Locked(NamedTuple):
    """What a caller of `turn_start` read under the conversation's row lock, which its transaction holds."""

    latest: Turn | None  # the conversation's latest turn (`latest_turn`)
    reaped: bool  # orphans among its turns were sent on before this transaction (`reaping_first`)


def reaping_first[T](turns: QuerySet[Turn], start: Callable[[bool], T]) -> T:
    """`start(reaped)`: a transaction that starts a turn, and raises UnfinishedTurn if it meets an
    unfinished one while `reaped` is False. Then those of `turns` whose node is gone are sent on, or
    failed (`turns_reap`), outside any transaction, so that a refusal rolling it back cannot bring the
    orphan back, and `start(True)` runs. A conversation is thus never blocked by a turn no node will
    finish, and the common case (nothing unfinished) reads nothing for it."""
    try:
        return start(False)
    except UnfinishedTurn:
        for turn_id in turns.exclude(status__in=Turn.FINISHED).values_list("pk", flat=True):
            turns_reap(turn_id=turn_id)
    return start(True)


def turn_start(
    *,
    conversation: Conversation,
    text: str,
    sampling: dict | None = None,
    policy: str | None = None,
    api_key: ApiKey | None = None,
    locked: Locked | None = None,
) -> Turn:
    """Store the user's message and its queued turn; its task is queued once both are durable.

    Every check runs before anything is written: the text, one reply at a time, its size, the user's
    quotas, a node to run it and room in that node's queue. `sampling` overrides the node's defaults
    (fields of inference.types.Sampling); `policy` is a routing policy alias; `api_key` is the key an API
    request came with (its own limits apply as well as its owner's).

    `locked`: the caller's transaction already holds the conversation's row lock (or created the row), and
    runs inside `reaping_first` (an API request, which stores the resent history first). The turn then
    starts in that transaction, and a refusal rolls it all back. Otherwise the turn starts in a
    transaction of its own.
    """
    text = check_message_text(text)
    start = partial(_start_locked, text=text, sampling=sampling, policy=policy, api_key=api_key)
    if locked is not None:
        return start(conversation, locked=locked)

    def in_transaction(reaped: bool) -> Turn:
        with transaction.atomic():
            row = Conversation.objects.select_for_update().get(pk=conversation.pk)
            return start(row, locked=Locked(latest_turn(row), reaped))

    return reaping_first(conversation.turns.all(), in_transaction)


def _start_locked(
    conversation: Conversation,
    *,
    locked: Locked,
    text: str,
    sampling: dict | None,
    policy: str | None,
    api_key: ApiKey | None,
) -> Turn:
    """The checks and the writes of `turn_start`, under the conversation's row lock."""
    if locked.latest is not None and not locked.latest.is_finished:
        if not locked.reaped:
            raise UnfinishedTurn
        raise ReplyInProgress("A reply is still being written; wait for it or stop it first.")
    served = check_message_fits(text, model=conversation.model)
    quotas.check_new_turn(user_id=conversation.owner_id, api_key_id=api_key.pk if api_key else None)
    hints = route_hints(conversation, served, locked.latest)
    try:
        node = session_node(
            session_key=conversation.session_key,
            policy=policy,
            model=conversation.model,
            cold=hints.cold,
            new=hints.new,
        )
    except NoHealthyNode as exc:
        raise NoNodeUp(str(exc)) from exc
    unfinished = Turn.objects.filter(node=node.name).exclude(status__in=Turn.FINISHED).count()
    if unfinished >= node.capacity * settings.CHAT_QUEUE_PER_SLOT:
        raise NodeBusy(f"The model is busy ({unfinished} replies queued); try again in a few seconds.")
    user_message = Message.objects.create(conversation=conversation, role=Message.Role.USER, content=text)
    turn = turn_create(
        conversation=conversation,
        user_message=user_message,
        node=node.name,
        sampling=sampling or {},
        api_key=api_key,
    )
    if remembered := _REMEMBER.match(text):  # "remember that ..." also saves a fact
        fact_save(owner=conversation.owner, text=remembered["fact"])
    if not conversation.title:
        conversation.title = text.splitlines()[0][:60]
    conversation.save(update_fields=["title", "updated_at"])
    return turn
