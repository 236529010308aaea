"""Running a conversation's strategy for a turn, on the node: stored state in, prompt tokens and trace out."""

import dataclasses
import time
from typing import TYPE_CHECKING

from django.conf import settings

from chatapp.memory.base import AssembledPrompt, MemoryContext, StoredMessage, StoredSummary, prompt_hash
from chatapp.memory.registry import strategy_get, strategy_options
from chatapp.models import Message, Summary, Turn, UserFact
from chatapp.selectors import message_search
from inference.chat_format import ChatMessage
from inference.engine import Sampling

if TYPE_CHECKING:
    from inference.engine import Engine

SUMMARY_TOKENS = 96
SUMMARY_INSTRUCTION = (
    "Summarize the conversation below in two or three sentences. Keep every name, place, number and fact.\n\n"
)


@dataclasses.dataclass(frozen=True)
class TurnPrompt:
    assembled: AssembledPrompt
    tokens: list[int]
    summary_cost: dict | None


def _stored(message: Message) -> StoredMessage:
    token_ids = tuple(message.token_ids) if message.token_ids is not None else None
    return StoredMessage(
        id=message.pk,
        role=message.role,  # type: ignore[arg-type]
        text=message.content,
        token_ids=token_ids,
        pinned=message.pinned,
        excluded=message.excluded,
    )


def _context(turn: Turn, engine: "Engine", sampling: Sampling) -> MemoryContext:
    conversation = turn.conversation
    history = Message.objects.filter(conversation=conversation, id__lt=turn.user_message_id).order_by(
        "created_at", "id"
    )
    previous = conversation.turns.filter(id__lt=turn.pk, status=Turn.Status.DONE).order_by("-id").first()
    fmt = engine.chat_format
    return MemoryContext(
        history=[_stored(m) for m in history],
        new_message=_stored(turn.user_message),
        budget=engine.n_ctx - sampling.max_tokens - fmt.overhead,
        count_tokens=fmt.count,
        system_prompt=conversation.system_prompt or settings.CHAT_SYSTEM_PROMPT,
        facts=list(UserFact.objects.filter(owner_id=conversation.owner_id).values_list("text", flat=True)),
        summaries=[StoredSummary(s.text, s.through_message_id) for s in conversation.summaries.all()],
        previous_first_id=previous.trace.get("first_verbatim") if previous else None,
        search=lambda query, ids: message_search(query=query, message_ids=ids),
    )


def turn_prompt(*, turn: Turn, engine: "Engine", sampling: Sampling) -> TurnPrompt:
    """Assemble the turn's prompt with its conversation's strategy; summarise dropped turns first if it asks."""
    strategy = strategy_get(turn.strategy, turn.strategy_options)
    context = _context(turn, engine, sampling)
    assembled = strategy.assemble(context)
    summary_cost = None
    if assembled.summarize_ids:
        summary, summary_cost = _summarize(turn, engine, assembled.summarize_ids)
        context = dataclasses.replace(context, summaries=[*context.summaries, summary])
        assembled = strategy.assemble(context)
    tokens = engine.chat_format.render(assembled.messages())
    return TurnPrompt(assembled, tokens, summary_cost)


def _summarize(turn: Turn, engine: "Engine", message_ids: tuple[int, ...]) -> tuple[StoredSummary, dict]:
    """The model writes the summary on this node (its own session key, so the chat's cache is untouched)."""
    messages = Message.objects.filter(pk__in=message_ids).order_by("created_at", "id")
    transcript = "\n".join(f"{'User' if m.role == 'user' else 'Assistant'}: {m.content}" for m in messages)
    prompt = engine.chat_format.render([ChatMessage("user", SUMMARY_INSTRUCTION + transcript)])
    started = time.perf_counter()
    generation = engine.generate(
        session_key=f"conversation:{turn.conversation_id}:summary",
        prompt=prompt,
        sampling=Sampling(max_tokens=SUMMARY_TOKENS, temperature=0, top_p=1, repeat_penalty=1.1),
    )
    ms = (time.perf_counter() - started) * 1000
    text = generation.text.strip() or "(no summary)"
    row = Summary.objects.create(
        conversation_id=turn.conversation_id,
        text=text,
        through_message_id=max(message_ids),
        prompt_tokens=len(prompt),
        completion_tokens=len(generation.token_ids),
        ms=ms,
    )
    cost = {"prompt_tokens": row.prompt_tokens, "completion_tokens": row.completion_tokens, "ms": round(ms, 1)}
    return StoredSummary(text, row.through_message_id), cost


def turn_record_prompt(*, turn: Turn, prompt: TurnPrompt, detokenize) -> None:
    """Store what the strategy resent and dropped, and the exact prompt, on the turn."""
    trace = prompt.assembled.trace()
    if prompt.summary_cost:
        trace["summary_cost"] = prompt.summary_cost
    turn.strategy_options = strategy_options(turn.strategy, turn.strategy_options)
    turn.trace = trace
    turn.prompt_hash = prompt_hash(prompt.tokens)
    turn.prompt_text = detokenize(prompt.tokens)
    turn.prompt_token_ids = prompt.tokens
    turn.save(update_fields=["strategy_options", "trace", "prompt_hash", "prompt_text", "prompt_token_ids"])
