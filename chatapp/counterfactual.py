"""What only this design can show about a turn: what every other configured strategy would have sent for
it and cost, and why the node's cache broke when it did.

The other strategies' figures come from the dry runs' own code (`chatapp.experiments.model_free`): the
conversation's stored messages up to the turn, replayed through each strategy as if the conversation had
used it from its first turn, with the stored replies' exact tokens. "Computed" is what that strategy's
prompt would not find in a session that held its previous prompt and reply. Summaries are stand-ins of
the right size, as in dry runs. Computed on demand and cached (the history before a finished turn does
not change; pins and exclusions apply as they are now).
"""

from dataclasses import dataclass

from django.conf import settings
from django.core.cache import cache
from django.db.models import QuerySet

from chatapp.experiments.model_free import ModelFreeSession
from chatapp.memory.assembly import names_of, stored_message, user_facts
from chatapp.memory.base import StoredMessage
from chatapp.memory.registry import strategy_aliases, strategy_get
from chatapp.models import Message, Turn
from chatapp.turn_inspection import segment_label
from chatapp.turns.admission import served_chat_format
from chatapp.validation import NoNodeUp
from inference.chat_format import ChatFormat
from inference.session_cache import common_prefix
from router.models import Node
from router.services import ServedModel, served_models

CACHE_SECONDS = 3600


@dataclass(frozen=True)
class WhatIf:
    strategy: str
    prompt_tokens: int
    computed_tokens: int  # not in a cache holding this strategy's previous prompt and reply
    dropped_ids: tuple[int, ...]
    actual: bool  # the strategy the turn ran with
    error: str = ""  # the strategy could not fit the turn (ContextOverflow)


@dataclass(frozen=True)
class CacheBreak:
    """Where this turn's prompt stopped extending the previous prompt and reply, and why."""

    at_token: int  # the first token that differs (the previous prompt and reply had `previous_tokens`)
    previous_tokens: int
    segment: str  # the segment that token belongs to
    cause: str


def turn_counterfactual(turn: Turn) -> list[WhatIf]:
    """For each configured strategy, what it would have sent for `turn` (cached per turn and settings).
    Raises NoNodeUp when no node of the turn's model is known, or its vocabulary is not here."""
    key = f"counterfactual:{turn.public_id}:{','.join(strategy_aliases())}"
    found = cache.get(key)
    if found is None:
        found = _replay_all(turn)
        cache.set(key, found, CACHE_SECONDS)
    return found


def _replay_all(turn: Turn) -> list[WhatIf]:
    served = _served(turn)
    fmt = served_chat_format(served)
    max_tokens = int(turn.sampling.get("max_tokens") or served.max_reply_tokens)
    budget = served.n_ctx - max_tokens - fmt.overhead
    stored = [stored_message(m, model=turn.model) for m in _messages_up_to(turn)]
    facts = user_facts(turn.conversation.owner_id)
    return [_replay(alias, turn, stored, facts, fmt, budget) for alias in strategy_aliases()]


def _replay(
    alias: str, turn: Turn, stored: list[StoredMessage], facts: list[str], fmt: ChatFormat, budget: int
) -> WhatIf:
    conversation = turn.conversation
    options = turn.strategy_options if alias == turn.strategy else None
    session = ModelFreeSession(
        strategy_get(alias, options),
        fmt,
        budget,
        names=names_of(conversation),
        system_prompt=conversation.system_prompt or settings.CHAT_SYSTEM_PROMPT,
        facts=facts,
    )
    result = None
    for index, message in enumerate(stored):
        if message.role != "user":
            continue
        reply = stored[index + 1] if index + 1 < len(stored) and stored[index + 1].role == "assistant" else None
        result = session.turn(message, reply if message.id != turn.user_message_id else None)
        if message.id == turn.user_message_id:
            break
    assert result is not None
    if result.assembled is None:
        return WhatIf(alias, 0, 0, (), alias == turn.strategy, result.error)
    return WhatIf(
        strategy=alias,
        prompt_tokens=len(result.prompt),
        computed_tokens=len(result.prompt) - result.reusable,
        dropped_ids=result.assembled.dropped_ids,
        actual=alias == turn.strategy,
    )


def _messages_up_to(turn: Turn) -> QuerySet[Message]:
    return Message.objects.filter(conversation_id=turn.conversation_id, id__lte=turn.user_message_id).order_by(
        "created_at", "id"
    )


def _served(turn: Turn) -> ServedModel:
    """The model's limits as its nodes registered them: the node that ran the turn, else any up now."""
    node = Node.objects.filter(name=turn.node).first() if turn.node else None
    if node is not None and node.n_ctx:
        return ServedModel(node.model, node.model_path, node.chat_template, node.n_ctx, node.max_reply_tokens)
    served = served_models().get(turn.model)
    if served is None:
        raise NoNodeUp(f"No node of the model {turn.model} is known, so neither are its limits.")
    return served


def cache_break(turn: Turn) -> CacheBreak | None:
    """Where and why the turn's prompt diverged from the conversation's previous prompt and reply; None if
    it extended them whole (or there is nothing to compare)."""
    if not turn.prompt_token_ids:
        return None
    previous = (
        Turn.objects.filter(conversation_id=turn.conversation_id, pk__lt=turn.pk, status=Turn.Status.DONE)
        .select_related("assistant_message")
        .last()
    )
    if previous is None or not previous.prompt_token_ids:
        if turn.conversation.branched_from_id and previous is None:
            return CacheBreak(0, 0, _segment_at(turn, 0), "an edit: this branch is a new session")
        return None
    reply = previous.assistant_message.token_ids if previous.assistant_message else None
    held = [*previous.prompt_token_ids, *(reply or [])]
    at = common_prefix(held, turn.prompt_token_ids)
    if at >= len(held):
        return None
    return CacheBreak(at, len(held), _segment_at(turn, at), _cause(previous, turn))


def _segment_at(turn: Turn, token: int) -> str:
    """The segment (or the template's own markers) that holds the prompt's `token`-th token."""
    at = 0
    for segment, _, _, tokens in turn.trace.get("parts", []):
        at += tokens
        if token < at:
            return "the template's markers" if segment < 0 else segment_label(turn, segment)
    return "the end of the prompt"


def _cause(previous: Turn, turn: Turn) -> str:
    """Why, from what the two turns recorded: the first difference that breaks a prefix."""
    before, now = previous.trace, turn.trace
    if (previous.strategy, previous.model) != (turn.strategy, turn.model):
        return "the strategy or the model changed"
    if _segment_tokens(before, "system") != _segment_tokens(now, "system"):
        return "the system prompt changed"
    if _segment_tokens(before, "pinned") != _segment_tokens(now, "pinned"):
        return "the pinned messages or saved facts changed"
    left = set(before.get("kept", [])) - set(now.get("kept", []))
    if set(now.get("summarized", [])) - set(before.get("summarized", [])):
        return "a summary was inserted"
    if before.get("retrieved", []) != now.get("retrieved", []) and left <= set(before.get("retrieved", [])):
        return "the retrieved messages changed"
    if left:
        return f"a drop: {len(left)} message{'s' if len(left) != 1 else ''} left the prompt"
    return "an earlier message was excluded, or its stored tokens changed"


def _segment_tokens(trace: dict, kind: str) -> list[int]:
    return [s["tokens"] for s in trace.get("segments", []) if s["kind"] == kind]
