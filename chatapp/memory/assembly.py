"""Running a conversation's strategy for a turn, on the node: stored state in, prompt tokens and trace out."""

import dataclasses
import time
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any, overload

from django.conf import settings

from chatapp.memory.base import AssembledPrompt, MemoryContext, StoredMessage, StoredSummary, prompt_hash
from chatapp.memory.registry import strategy_get, strategy_options
from chatapp.memory.summaries import (
    CHUNK_TOKENS,
    SUMMARY_INSTRUCTION,
    SUMMARY_TOKENS,
    SummaryJob,
    summaries_bring_up_to_date,
)
from chatapp.models import Conversation, Message, Summary, Turn, UserFact
from chatapp.selectors import message_search
from inference.chat_templates import ChatMessage
from inference.types import Sampling

if TYPE_CHECKING:
    from inference.chat_format import ChatFormat
    from inference.engine import Engine


@dataclasses.dataclass(frozen=True)
class TurnPrompt:
    assembled: AssembledPrompt
    tokens: list[int]


def stored_message(message: Message, *, model: str) -> StoredMessage:
    """A stored message as strategies see it; its token ids only for prompts of the model that wrote them."""
    token_ids = tuple(message.token_ids) if message.token_ids is not None and message.model == model else None
    return StoredMessage(
        id=message.pk,
        role=message.role,  # type: ignore[arg-type]
        text=message.content,
        token_ids=token_ids,
        pinned=message.pinned,
        excluded=message.excluded,
        sent_at=message.created_at,
    )


def names_of(conversation: Conversation) -> dict[str, str]:
    return {"user": conversation.user_name, "assistant": conversation.assistant_name}


def user_facts(owner_id: int) -> list[str]:
    """The texts of the user's saved facts, as strategies see them."""
    return list(UserFact.objects.filter(owner_id=owner_id).values_list("text", flat=True))


def stored_summaries(conversation: Conversation) -> list[StoredSummary]:
    return [StoredSummary(s.text, s.through_message_id, s.first_message_id or 0) for s in conversation.summaries.all()]


def _history(turn: Turn, model: str, *, with_own: bool = False) -> list[StoredMessage]:
    """Every message of the conversation stored before the turn's own (and that one last, `with_own`)."""
    own = turn.user_message_id
    upto = {"id__lte": own} if with_own else {"id__lt": own}
    stored = Message.objects.filter(conversation_id=turn.conversation_id, **upto).order_by("created_at", "id")
    # Stable: the turn's own message last, the others in their order.
    return sorted((stored_message(m, model=model) for m in stored), key=lambda m: m.id == own)


class _ReadOnUse[T](Sequence[T]):
    """Stored rows read when a strategy first looks at them: most strategies never read facts or summaries,
    and their two queries would run before every turn's first token."""

    def __init__(self, read: Callable[[], list[T]]) -> None:
        self._read = read

    @cached_property
    def _rows(self) -> list[T]:
        return self._read()

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        return self._rows[index]

    def __len__(self) -> int:
        return len(self._rows)


def _context(turn: Turn, engine: "Engine", sampling: Sampling) -> MemoryContext:
    """Everything the strategy may read: two queries before every turn's first token, and the user's facts
    and the conversation's summaries (one query each) only for a strategy that reads them."""
    conversation = turn.conversation
    *history, new_message = _history(turn, engine.model, with_own=True)
    earlier = conversation.turns.filter(id__lt=turn.pk, status=Turn.Status.DONE).order_by("id")
    traced = list(earlier.values_list("user_message_id", "trace__recalled", "trace__first_verbatim"))
    fmt = engine.chat_format
    return MemoryContext(
        history=history,
        new_message=new_message,
        budget=engine.n_ctx - sampling.max_tokens - fmt.overhead,
        count_tokens=fmt.count,
        system_prompt=conversation.system_prompt or settings.CHAT_SYSTEM_PROMPT,
        facts=_ReadOnUse(lambda: user_facts(conversation.owner_id)),
        summaries=_ReadOnUse(lambda: stored_summaries(conversation)),
        previous_first_id=traced[-1][2] if traced else None,
        search=lambda query, ids: message_search(query=query, message_ids=ids),
        recalled={user_id: tuple(ids) for user_id, ids, _ in traced if ids},
        names=names_of(conversation),
    )


def turn_prompt(*, turn: Turn, engine: "Engine", sampling: Sampling) -> TurnPrompt:
    """Assemble the turn's prompt with its conversation's strategy, from stored state only."""
    strategy = strategy_get(turn.strategy, turn.strategy_options)
    assembled = strategy.assemble(_context(turn, engine, sampling))
    return TurnPrompt(assembled, engine.chat_format.render(assembled.messages()))


def turn_summarize(*, turn: Turn, engine: "Engine") -> list[StoredSummary]:
    """After a reply: summarise what the turn's prompt dropped and no summary covers yet, in chunks that fit
    (strategies with `summarize` only). Runs on the node, off the first-token path."""
    if not strategy_get(turn.strategy, turn.strategy_options).summarize:
        return []
    conversation = turn.conversation
    fmt = engine.chat_format

    def write(job: SummaryJob) -> StoredSummary:
        prompt = fmt.render([ChatMessage("user", SUMMARY_INSTRUCTION + job.transcript)])
        started = time.perf_counter()
        generation = engine.generate(
            session_key=f"{conversation.session_key}:summary",
            prompt=prompt,
            sampling=Sampling(max_tokens=SUMMARY_TOKENS, temperature=0, top_p=1, repeat_penalty=1.1),
        )
        row = Summary.objects.create(
            conversation=conversation,
            text=generation.text.strip() or "(no summary)",
            first_message_id=job.first_message_id,
            through_message_id=job.through_message_id,
            prompt_tokens=len(prompt),
            completion_tokens=len(generation.token_ids),
            ms=(time.perf_counter() - started) * 1000,
        )
        return StoredSummary(row.text, job.through_message_id, job.first_message_id)

    return summaries_bring_up_to_date(
        history=_history(turn, engine.model),
        window_start=turn.trace.get("first_verbatim") or 0,
        summaries=stored_summaries(conversation),
        count_text=lambda text: len(fmt.text_tokens(text)),
        write=write,
        names=names_of(conversation),
        chunk_tokens=summary_chunk_tokens(engine),
    )


def summary_chunk_tokens(engine: "Engine") -> int:
    """The longest transcript a summarising prompt can hold on this engine, up to CHUNK_TOKENS."""
    fmt = engine.chat_format
    instruction = fmt.count([ChatMessage("user", SUMMARY_INSTRUCTION)])
    return min(CHUNK_TOKENS, engine.n_ctx - SUMMARY_TOKENS - instruction - fmt.overhead - 16)


def prompt_record(turn: Turn, prompt: TurnPrompt, fmt: "ChatFormat") -> dict[str, Any]:
    """The turn's fields that record what the strategy resent and dropped, and the exact prompt."""
    text, parts = prompt_parts(prompt, fmt)
    return {
        "strategy_options": strategy_options(turn.strategy, turn.strategy_options),
        "trace": {**prompt.assembled.trace(), "parts": parts},
        "prompt_hash": prompt_hash(prompt.tokens),
        "prompt_text": text,
        "prompt_token_ids": prompt.tokens,
    }


def prompt_parts(prompt: TurnPrompt, fmt: "ChatFormat") -> tuple[str, list[list[int]]]:
    """The prompt as text (template markers visible), and where each part of it came from: runs of
    [segment index (-1: the template's own), 1 for a template marker else 0, characters, tokens], in order."""
    owners = [index for index, segment in enumerate(prompt.assembled.segments) for _ in segment.messages]
    texts: list[str] = []
    runs: list[list[int]] = []
    at = 0
    for piece, n in fmt.annotated(prompt.assembled.messages()):
        text = fmt.display(prompt.tokens[at : at + n])
        at += n
        part = [-1 if piece.owner is None else owners[piece.owner], int(piece.marker or piece.bos)]
        if runs and runs[-1][:2] == part:
            runs[-1][2] += len(text)
            runs[-1][3] += n
        elif n:
            runs.append([*part, len(text), n])
        texts.append(text)
    return "".join(texts), runs
