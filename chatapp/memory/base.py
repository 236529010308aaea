"""Memory assembly: what of a conversation's stored history is resent to the model, and what is dropped.

A strategy turns a `MemoryContext` (the stored history, the new user message,
a token budget, and the stored state it may depend on) into an
`AssembledPrompt`: ordered segments with their token counts and the ids of
the messages kept, dropped, summarised and retrieved. Strategies are pure
and deterministic: the same context always gives the same prompt.

A strategy class chooses *which verbatim messages* stay (its `select`); the
add-ons every strategy can switch on by OPTIONS live here, once:
`pinned` (pinned messages and the user's saved facts in a fixed slot after
the system prompt), `summarize` (the summaries stored so far, placed before
the verbatim window), `retrieve` (dropped messages that match the new
message by Postgres full-text search, placed right before it) and
`recall_tokens` (earlier turns ranked by BM25, quoted in one block right
before the new message; the block stays in front of that message in later
prompts, so the prompt only grows and the node's prefix cache keeps hitting).
"""

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Literal

from chatapp.memory import lexical
from inference.chat_templates import ChatMessage

SegmentKind = Literal["system", "pinned", "summary", "retrieved", "recalled", "verbatim"]
RECALL_HEADING = "Earlier in this conversation:"
MIN_LINE_TOKENS = 8  # a recalled block stops looking for turns that fit once less than this is left


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
    sent_at: datetime | None = None

    def chat(self) -> ChatMessage:
        return ChatMessage(role=self.role, text=self.text, token_ids=self.token_ids)


@dataclass(frozen=True)
class StoredSummary:
    text: str
    through_message_id: int  # the last message it folds in
    first_message_id: int = 0  # the first (a roll-up of earlier summaries starts where the first of them did)


def current_summaries(summaries: Sequence[StoredSummary]) -> list[StoredSummary]:
    """The summaries not folded into a roll-up (one whose range holds theirs), oldest first."""

    def inside(s: StoredSummary, o: StoredSummary) -> bool:
        return o is not s and o.first_message_id <= s.first_message_id and o.through_message_id >= s.through_message_id

    ordered = sorted(summaries, key=lambda s: (s.through_message_id, s.first_message_id))
    return [s for s in ordered if not any(inside(s, o) for o in ordered)]


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
    # For each earlier user message, the messages its own turn recalled in front of it (turn traces).
    recalled: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    names: Mapping[str, str] = field(default_factory=lambda: {"user": "User", "assistant": "Assistant"})

    @cached_property
    def quotable(self) -> dict[int, StoredMessage]:
        """The history that may be quoted, by id (excluded messages never are); built once per prompt."""
        return {m.id: m for m in self.history if not m.excluded}


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
    recalled_ids: tuple[int, ...] = ()  # quoted in this turn's own block, before the new message
    tokens: int = 0
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
            "recalled": list(self.recalled_ids),
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
    # Tokens of earlier turns to quote before the new message (0: off); a float up to 1 is a share of the budget.
    recall_tokens: float = 0
    recall_neighbors: float = 0.3  # how much a turn's neighbours' match lifts it
    recall_session: float = 0.5  # how much the best match in a turn's session lifts it
    recall_speaker: float = 0.2  # how much a turn is lifted when the new message names its speaker
    # Recall quotes earlier sittings only (a sitting ends after this many minutes of silence); the current
    # sitting is the window's, so a question asked a minute ago does not crowd out what was said last month.
    # 0: every turn not in the prompt may be quoted.
    recall_gap_minutes: float = 60

    prefix_stable = False  # consecutive prompts share their prefix except at rare, chunked drops

    def breaks_prefix(self, *, history_tokens: int, budget: int) -> bool:
        """Whether the next prompt, with `history_tokens` of verbatim history before its new message, will
        stop extending the previous one (a chunked drop): its session's cache is no use to it, so the router
        may move the session for free. False when the strategy cannot tell."""
        return False

    def assemble(self, context: MemoryContext) -> AssembledPrompt:
        """The prompt for `context`; raises ContextOverflow when it cannot fit."""
        eligible = [m for m in context.history if not m.excluded]
        pinned = [m for m in eligible if self.pinned and m.pinned]
        summaries = current_summaries(context.summaries) if self.summarize else []
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
        body = self._verbatim_segments(context, chosen)
        in_prompt = pinned_ids | {i for segment in body for i in segment.message_ids}
        left = context.budget - fixed - sum(self._count(context, s.messages) for s in body)
        retrieved = self._retrieve(context, [m for m in candidates if m.id not in in_prompt], left)
        if retrieved:
            body.append(Segment("retrieved", tuple(chat(retrieved)), tuple(m.id for m in retrieved)))
            in_prompt |= {m.id for m in retrieved}
            left -= self._count(context, body[-1].messages)
        recalled = self._recall(context, [m for m in eligible if m.id not in in_prompt], left)
        if recalled:
            body.append(self._recall_segment(context, recalled))
            in_prompt |= {m.id for m in recalled}
        segments = [_measured(context, s) for s in [*head, *body, newest] if s.messages]
        return AssembledPrompt(
            segments=tuple(segments),
            kept_ids=(*(m.id for m in eligible if m.id in in_prompt), context.new_message.id),
            dropped_ids=tuple(m.id for m in context.history if m.id not in in_prompt),
            summarized_ids=tuple(m.id for m in eligible if m.id <= covered and m.id not in in_prompt),
            retrieved_ids=tuple(m.id for m in retrieved),
            recalled_ids=tuple(m.id for m in recalled),
            tokens=sum(s.tokens for s in segments),
            first_verbatim_id=chosen[0].id if chosen else context.new_message.id,
        )

    def select(self, context: MemoryContext, candidates: list[StoredMessage], budget: int) -> list[StoredMessage]:
        """The verbatim history to keep: a subset of `candidates`, in order, within `budget` tokens
        (measured with `cost`, which counts the blocks that ride with them)."""
        raise NotImplementedError

    def cost(self, context: MemoryContext, messages: Sequence[StoredMessage]) -> int:
        """Tokens these verbatim messages take in a prompt, with the recalled blocks in front of them."""
        return sum(self._count(context, s.messages) for s in self._verbatim_segments(context, messages))

    # Add-ons ------------------------------------------------------------------

    def _head(self, context: MemoryContext, pinned: list[StoredMessage]) -> list[Segment]:
        head = [Segment("system", (ChatMessage("system", context.system_prompt),))] if context.system_prompt else []
        if not self.pinned:
            return head  # the facts are not read: on the node that is a query saved
        lines = [*(f"- {fact}" for fact in context.facts), *(f"- {m.role}: {m.text}" for m in pinned)]
        if lines:
            text = "Things to remember:\n" + "\n".join(lines)
            head.append(Segment("pinned", (ChatMessage("system", text),), tuple(m.id for m in pinned)))
        return head

    @staticmethod
    def _summary_segment(summaries: Sequence[StoredSummary]) -> list[Segment]:
        """Summaries are append-only, oldest first, so the prefix before the verbatim window stays stable."""
        texts = tuple(ChatMessage("system", f"Summary of earlier conversation: {s.text}") for s in summaries)
        return [Segment("summary", texts)] if texts else []

    def _verbatim_segments(self, context: MemoryContext, messages: Sequence[StoredMessage]) -> list[Segment]:
        """`messages` as verbatim segments, each user message preceded by the block its own turn recalled
        (when this strategy recalls): re-rendered from the same ids, so the tokens are the same."""
        if not (self.recall_tokens and context.recalled):
            return [Segment("verbatim", tuple(chat(messages)), tuple(m.id for m in messages))] if messages else []
        segments: list[Segment] = []
        run: list[StoredMessage] = []
        for message in messages:
            quoted = [context.quotable[i] for i in context.recalled.get(message.id, ()) if i in context.quotable]
            if quoted:
                if run:
                    segments.append(Segment("verbatim", tuple(chat(run)), tuple(m.id for m in run)))
                    run = []
                segments.append(self._recall_segment(context, quoted))
            run.append(message)
        if run:
            segments.append(Segment("verbatim", tuple(chat(run)), tuple(m.id for m in run)))
        return segments

    def _retrieve(self, context: MemoryContext, dropped: list[StoredMessage], budget: int) -> list[StoredMessage]:
        if not self.retrieve or not dropped:
            return []
        by_id = {m.id: m for m in dropped}
        found: list[StoredMessage] = []
        for message_id in context.search(context.new_message.text, list(by_id))[: self.retrieve]:
            if message_id in by_id and self._count(context, chat([*found, by_id[message_id]])) <= budget:
                found.append(by_id[message_id])
        return sorted(found, key=lambda m: m.id)

    def _recall(self, context: MemoryContext, absent: list[StoredMessage], budget: int) -> list[StoredMessage]:
        """The best-ranked of the messages not in the prompt and from earlier sittings, as many as fit in
        `recall_tokens` and `budget`."""
        budget = min(budget, tokens_of(self.recall_tokens, context.budget))
        if budget <= 0 or not absent:
            return []
        start = _sitting_start(context, self.recall_gap_minutes) if self.recall_gap_minutes else None
        if start is not None:
            absent = [m for m in absent if m.sent_at is None or m.sent_at < start]
        documents = [
            lexical.Document(m.id, f"{_speaker(context, m)} {m.text}", _day(m), _speaker(context, m)) for m in absent
        ]
        ranked = lexical.rank(
            context.new_message.text,
            documents,
            neighbors=self.recall_neighbors,
            session=self.recall_session,
            speaker=self.recall_speaker,
        )
        by_id = {m.id: m for m in absent}
        chosen: list[StoredMessage] = []
        used = self._count(context, [ChatMessage("user", RECALL_HEADING)])
        days: set = set()
        for message_id in ranked:
            if budget - used < MIN_LINE_TOKENS:
                break
            message = by_id[message_id]
            cost = self._count(context, [ChatMessage("system", _line(context, message))])
            if _day(message) not in days:
                cost += self._count(context, [ChatMessage("system", _day_heading(message))])
            if used + cost <= budget:
                chosen.append(message)
                days.add(_day(message))
                used += cost
        chosen.sort(key=lambda m: m.id)
        while chosen and self._count(context, self._recall_segment(context, chosen).messages) > budget:
            chosen.remove(by_id[next(i for i in reversed(ranked) if by_id[i] in chosen)])
        return chosen

    @staticmethod
    def _recall_segment(context: MemoryContext, messages: Sequence[StoredMessage]) -> Segment:
        """One user-role block quoting `messages` in conversation order, under a heading per day."""
        lines = [RECALL_HEADING]
        day = None
        for message in messages:
            if message.sent_at is not None and _day(message) != day:
                day = _day(message)
                lines.append(_day_heading(message))
            lines.append(_line(context, message))
        text = "\n".join(lines)
        return Segment("recalled", (ChatMessage("user", text),), tuple(m.id for m in messages))

    @staticmethod
    def _count(context: MemoryContext, messages: Sequence[ChatMessage]) -> int:
        return context.count_tokens(messages) if messages else 0


def _sitting_start(context: MemoryContext, gap_minutes: float) -> datetime | None:
    """When the current sitting began: the newest message's time, walked back over gaps under `gap_minutes`."""
    start = context.new_message.sent_at
    if start is None:
        return None
    for message in reversed(context.history):
        if message.sent_at is None or (start - message.sent_at).total_seconds() >= gap_minutes * 60:
            break
        start = min(start, message.sent_at)
    return start


def tokens_of(value: float, budget: int) -> int:
    """A size option in tokens: an int is tokens, a float up to 1 a share of the prompt's budget."""
    return int(value * budget) if isinstance(value, float) and value <= 1 else int(value)


def _speaker(context: MemoryContext, message: StoredMessage) -> str:
    return context.names.get(message.role, message.role)


def _line(context: MemoryContext, message: StoredMessage) -> str:
    return f"{_speaker(context, message)}: {message.text}"


def _day(message: StoredMessage):
    return message.sent_at.date() if message.sent_at else None


def _day_heading(message: StoredMessage) -> str:
    return f"[{message.sent_at:%-d %B %Y}]" if message.sent_at else ""


def chat(messages: Sequence[StoredMessage]) -> list[ChatMessage]:
    return [m.chat() for m in messages]


def _measured(context: MemoryContext, segment: Segment) -> Segment:
    return Segment(segment.kind, segment.messages, segment.message_ids, context.count_tokens(segment.messages))
