"""A conversation assembled turn after turn without a model (dry replays, bench_memory).

It keeps what a node and the stored turns would keep between turns: the previous prompt and reply (so
`reusable` is what a perfect prefix cache would reuse), the previous prompt's first verbatim message,
each message's recalled block, and summaries (stand-ins of the right size, written after each turn).
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from django.conf import settings

from chatapp.memory.base import (
    AssembledPrompt,
    ContextOverflow,
    MemoryContext,
    MemoryStrategy,
    StoredMessage,
    StoredSummary,
)
from chatapp.memory.summaries import stand_in_writer, summaries_bring_up_to_date
from chatapp.selectors import text_search
from inference.chat_format import ChatFormat
from inference.session_cache import common_prefix


@dataclass(frozen=True)
class ModelFreeTurn:
    assembled: AssembledPrompt | None  # None: the strategy refused (ContextOverflow, in `error`)
    prompt: list[int]
    reusable: int  # prompt tokens shared with the previous prompt and reply
    assembly_ms: float
    error: str = ""


@dataclass
class ModelFreeSession:
    strategy: MemoryStrategy
    fmt: ChatFormat
    budget: int
    history: list[StoredMessage] = field(default_factory=list)
    names: dict[str, str] = field(default_factory=lambda: {"user": "User", "assistant": "Assistant"})
    summaries: list[StoredSummary] = field(default_factory=list)
    recalled: dict[int, tuple[int, ...]] = field(default_factory=dict)
    previous: list[int] = field(default_factory=list)
    first_verbatim: int | None = None
    system_prompt: str = field(default_factory=lambda: settings.CHAT_SYSTEM_PROMPT)
    facts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._texts = {m.id: m.text for m in self.history}
        self._search = text_searcher(self._texts)
        self._write_summary = stand_in_writer(self.fmt)

    def turn(self, new: StoredMessage, reply: StoredMessage | None) -> ModelFreeTurn:
        """Assemble `new`'s prompt, then add `new` and (unless the strategy refused) `reply` to the history
        (None: the turn got no reply)."""
        context = MemoryContext(
            history=list(self.history),
            new_message=new,
            budget=self.budget,
            count_tokens=self.fmt.count,
            system_prompt=self.system_prompt,
            facts=self.facts,
            summaries=list(self.summaries),
            previous_first_id=self.first_verbatim,
            search=self._search,
            recalled=dict(self.recalled),
            names=self.names,
        )
        started = time.perf_counter()
        try:
            assembled = self.strategy.assemble(context)
        except ContextOverflow as exc:
            self._add(new)
            return ModelFreeTurn(None, [], 0, (time.perf_counter() - started) * 1000, str(exc))
        ms = (time.perf_counter() - started) * 1000
        prompt = self.fmt.render(assembled.messages())
        done = ModelFreeTurn(assembled, prompt, common_prefix(self.previous, prompt), ms)
        self._add(new, *([reply] if reply else []))
        self.previous = [*prompt, *((reply.token_ids or ()) if reply else ())]
        self.first_verbatim = assembled.first_verbatim_id
        self.recalled[new.id] = assembled.recalled_ids
        if self.strategy.summarize:
            self.summaries = summaries_bring_up_to_date(
                history=self.history,
                window_start=assembled.first_verbatim_id or 0,
                summaries=self.summaries,
                count_text=lambda text: len(self.fmt.text_tokens(text)),
                write=self._write_summary,
                names=self.names,
            )
        return done

    def _add(self, *messages: StoredMessage) -> None:
        self.history += messages
        self._texts.update({m.id: m.text for m in messages})


def text_searcher(texts: dict[int, str]) -> Callable[[str, Sequence[int]], list[int]]:
    """The live full-text search, over texts that are not stored (it reads `texts` as it is when called)."""

    def search(query: str, ids: Sequence[int]) -> list[int]:
        return text_search(query=query, texts={i: texts[i] for i in ids})

    return search
