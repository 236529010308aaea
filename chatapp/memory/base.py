"""Memory assembly: what of a conversation's stored history is resent to the model, and what is dropped.

A strategy turns a `MemoryContext` (the stored history, the new user message,
a token budget, and the stored state it may depend on) into an
`AssembledPrompt`: ordered segments with their token counts and the ids of
the messages kept, dropped, summarised and retrieved. Strategies are pure
and deterministic: the same context always gives the same prompt.

A strategy class chooses *which verbatim messages* stay (its `select`); the
add-ons every strategy can switch on by OPTIONS live here, once:
`pinned` (pinned messages and the user's saved facts in a fixed slot after
the system prompt), `summarize` (dropped turns folded into model-written
summaries placed before the verbatim window) and `retrieve` (dropped
messages that match the new message, placed right before it).
"""

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from inference.chat_format import ChatMessage

SegmentKind = Literal["system", "pinned", "summary", "retrieved", "verbatim"]


class ContextOverflow(ValueError):
    """Even the smallest prompt the strategy allows does not fit the budget."""


@dataclass(frozen=True)
class StoredMessage:
    id: int
    role: Literal["user", "assistant"]
    text: str
    token_ids: tuple[int, ...] | None = None
    pinned: bool = False
    excluded: bool = False

    def chat(self) -> ChatMessage:
        return ChatMessage(role=self.role, text=self.text, token_ids=self.token_ids)


@dataclass(frozen=True)
class StoredSummary:
    text: str
    through_message_id: int  # the last message it folds in


@dataclass(frozen=True)
class MemoryContext:
    history: Sequence[StoredMessage]  # every stored message before the new one, oldest first
    new_message: StoredMessage
    budget: int  # prompt tokens allowed (context minus the reply's budget)
    count_tokens: Callable[[Sequence[ChatMessage]], int]  # tokens of these messages rendered as a prompt
    system_prompt: str = ""
    facts: Sequence[str] = ()
    summaries: Sequence[StoredSummary] = ()
    previous_first_id: int | None = None  # first verbatim message of the previous turn's prompt
    search: Callable[[str, Sequence[int]], list[int]] = lambda query, ids: []  # matching ids among `ids`, best first


@dataclass(frozen=True)
class Segment:
    kind: SegmentKind
    messages: tuple[ChatMessage, ...]
    message_ids: tuple[int, ...] = ()
    tokens: int = 0


@dataclass(frozen=True)
class AssembledPrompt:
    segments: tuple[Segment, ...]
    kept_ids: tuple[int, ...]
    dropped_ids: tuple[int, ...]
    summarized_ids: tuple[int, ...] = ()
    retrieved_ids: tuple[int, ...] = ()
    tokens: int = 0
    # Dropped turns the strategy wants summarised before it can assemble (summarize=True); empty when ready.
    summarize_ids: tuple[int, ...] = ()
    first_verbatim_id: int | None = None

    def messages(self) -> list[ChatMessage]:
        return [m for segment in self.segments for m in segment.messages]

    def trace(self) -> dict:
        """What a turn records: every id kept, dropped, summarised and retrieved, and tokens per segment."""
        return {
            "kept": list(self.kept_ids),
            "dropped": list(self.dropped_ids),
            "summarized": list(self.summarized_ids),
            "retrieved": list(self.retrieved_ids),
            "first_verbatim": self.first_verbatim_id,
            "tokens": self.tokens,
            "segments": [{"kind": s.kind, "ids": list(s.message_ids), "tokens": s.tokens} for s in self.segments],
        }


def prompt_hash(tokens: Sequence[int]) -> str:
    return hashlib.sha256(b",".join(str(t).encode() for t in tokens)).hexdigest()[:32]


@dataclass
class MemoryStrategy:
    """Subclasses choose the verbatim history (`select`); the add-ons are switched on by OPTIONS."""

    pinned: bool = False
    summarize: bool = False
    retrieve: int = 0  # how many dropped messages to bring back by full-text search

    prefix_stable = False  # consecutive prompts share their prefix except at rare, chunked drops

    def assemble(self, context: MemoryContext) -> AssembledPrompt:
        """The prompt for `context`; raises ContextOverflow when it cannot fit."""
        eligible = [m for m in context.history if not m.excluded]
        pinned = [m for m in eligible if self.pinned and m.pinned]
        summaries = list(context.summaries) if self.summarize else []
        covered = max((s.through_message_id for s in summaries), default=0)
        pinned_ids = {m.id for m in pinned}
        candidates = [m for m in eligible if m.id not in pinned_ids and m.id > covered]
        head = [*self._head(context, pinned), *self._summary_segment(summaries)]
        newest = Segment("verbatim", (context.new_message.chat(),), (context.new_message.id,))
        fixed = sum(self._count(context, s.messages) for s in [*head, newest])
        if fixed > context.budget:
            raise ContextOverflow(
                f"The prompt needs {fixed} tokens before any history, over its {context.budget}-token budget."
            )
        chosen = self.select(context, candidates, context.budget - fixed)
        chosen_ids = {m.id for m in chosen}
        dropped = [m for m in candidates if m.id not in chosen_ids]
        if self.summarize and dropped:
            return _summary_request(dropped)
        retrieved = self._retrieve(context, dropped, context.budget - fixed - self._count(context, chat(chosen)))
        body = [Segment("verbatim", tuple(chat(chosen)), tuple(m.id for m in chosen))]
        if retrieved:
            body.append(Segment("retrieved", tuple(chat(retrieved)), tuple(m.id for m in retrieved)))
        segments = [_measured(context, s) for s in [*head, *body, newest] if s.messages]
        kept = pinned_ids | chosen_ids | {m.id for m in retrieved}
        return AssembledPrompt(
            segments=tuple(segments),
            kept_ids=(*(m.id for m in eligible if m.id in kept), context.new_message.id),
            dropped_ids=tuple(m.id for m in context.history if m.id not in kept),
            summarized_ids=tuple(m.id for m in eligible if m.id <= covered and m.id not in pinned_ids),
            retrieved_ids=tuple(m.id for m in retrieved),
            tokens=sum(s.tokens for s in segments),
            first_verbatim_id=chosen[0].id if chosen else context.new_message.id,
        )

    def select(self, context: MemoryContext, candidates: list[StoredMessage], budget: int) -> list[StoredMessage]:
        """The verbatim history to keep: a subset of `candidates`, in order, within `budget` tokens."""
        raise NotImplementedError

    # Add-ons ------------------------------------------------------------------

    def _head(self, context: MemoryContext, pinned: list[StoredMessage]) -> list[Segment]:
        head = [Segment("system", (ChatMessage("system", context.system_prompt),))] if context.system_prompt else []
        lines = [*(f"- {fact}" for fact in context.facts), *(f"- {m.role}: {m.text}" for m in pinned)]
        if self.pinned and lines:
            text = "Things to remember:\n" + "\n".join(lines)
            head.append(Segment("pinned", (ChatMessage("system", text),), tuple(m.id for m in pinned)))
        return head

    @staticmethod
    def _summary_segment(summaries: Sequence[StoredSummary]) -> list[Segment]:
        """Summaries are append-only, oldest first, so the prefix before the verbatim window stays stable."""
        texts = tuple(ChatMessage("system", f"Summary of earlier conversation: {s.text}") for s in summaries)
        return [Segment("summary", texts)] if texts else []

    def _retrieve(self, context: MemoryContext, dropped: list[StoredMessage], budget: int) -> list[StoredMessage]:
        if not self.retrieve or not dropped:
            return []
        by_id = {m.id: m for m in dropped}
        found: list[StoredMessage] = []
        for message_id in context.search(context.new_message.text, list(by_id))[: self.retrieve]:
            if message_id in by_id and self._count(context, chat([*found, by_id[message_id]])) <= budget:
                found.append(by_id[message_id])
        return sorted(found, key=lambda m: m.id)

    @staticmethod
    def _count(context: MemoryContext, messages: Sequence[ChatMessage]) -> int:
        return context.count_tokens(messages) if messages else 0


def chat(messages: Sequence[StoredMessage]) -> list[ChatMessage]:
    return [m.chat() for m in messages]


def _measured(context: MemoryContext, segment: Segment) -> Segment:
    return Segment(segment.kind, segment.messages, segment.message_ids, context.count_tokens(segment.messages))


def _summary_request(dropped: list[StoredMessage]) -> AssembledPrompt:
    """Ask the caller to summarise `dropped` first (it stores the summary, then assembles again)."""
    return AssembledPrompt(
        segments=(), kept_ids=(), dropped_ids=tuple(m.id for m in dropped), summarize_ids=tuple(m.id for m in dropped)
    )
