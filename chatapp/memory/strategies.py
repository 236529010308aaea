"""The shipped strategies: each chooses which verbatim history stays (see `base` for the add-ons)."""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from chatapp.memory.base import ContextOverflow, MemoryContext, MemoryStrategy, StoredMessage, tokens_of

Exchange = list[StoredMessage]


def exchanges(messages: list[StoredMessage]) -> list[Exchange]:
    """Group messages into exchanges, each opening on a user message, so a prompt never starts mid-reply."""
    groups: list[Exchange] = []
    for message in messages:
        if message.role == "user" or not groups:
            groups.append([])
        groups[-1].append(message)
    return groups


def flatten(groups: list[Exchange]) -> list[StoredMessage]:
    return [m for group in groups for m in group]


def newest_that_fit(
    groups: list[Exchange], budget: int, cost_of: Callable[[Sequence[StoredMessage]], int]
) -> list[Exchange]:
    """The longest run of the newest exchanges within `budget` tokens."""
    kept: list[Exchange] = []
    used = 0
    for group in reversed(groups):
        cost = cost_of(group)
        if used + cost > budget:
            break
        kept.insert(0, group)
        used += cost
    return kept


class Full(MemoryStrategy):
    """Everything, until the context is full; then the turn fails saying so (it never silently overflows)."""

    def select(self, context: MemoryContext, candidates: list[StoredMessage], budget: int) -> list[StoredMessage]:
        needed = self.cost(context, candidates)
        if needed > budget:
            raise ContextOverflow(
                f"The conversation needs {needed} tokens of history but only {budget} fit in the model's context; "
                "start a new conversation or switch to a strategy that drops old turns."
            )
        return candidates


@dataclass
class Window(MemoryStrategy):
    """The last `exchanges` exchanges (fewer if they do not fit)."""

    exchanges: int = 8

    def select(self, context: MemoryContext, candidates: list[StoredMessage], budget: int) -> list[StoredMessage]:
        recent = exchanges(candidates)[-self.exchanges :] if self.exchanges > 0 else []
        return flatten(newest_that_fit(recent, budget, partial(self.cost, context)))


@dataclass
class TokenBudget(MemoryStrategy):
    """Newest exchanges first, within `history_tokens` (and the context); the system prompt is always kept."""

    history_tokens: int = 2048

    def select(self, context: MemoryContext, candidates: list[StoredMessage], budget: int) -> list[StoredMessage]:
        budget = min(budget, self.history_tokens)
        return flatten(newest_that_fit(exchanges(candidates), budget, partial(self.cost, context)))


@dataclass
class StablePrefix(MemoryStrategy):
    """Cache-aware: keep the history's start fixed until it passes `high` tokens, then drop old exchanges in
    one chunk down to `low`. Between drops each prompt extends the previous one token for token, so the
    node's prefix cache keeps hitting; a drop costs one cold prefill of the remaining history. With
    `recall_tokens`, the recalled block takes what the window leaves (the window's own blocks count in it)."""

    high: float = 3000  # tokens; a float up to 1 is a share of the prompt's budget (as `low`, `recall_tokens`)
    low: float = 1500
    prefix_stable = True

    def __post_init__(self) -> None:
        if not 0 <= tokens_of(self.low, 1 << 20) <= tokens_of(self.high, 1 << 20):
            raise ValueError(f"need 0 <= low <= high, got low={self.low}, high={self.high}")

    def breaks_prefix(self, *, history_tokens: int, budget: int) -> bool:
        return history_tokens > min(tokens_of(self.high, budget), budget)

    def select(self, context: MemoryContext, candidates: list[StoredMessage], budget: int) -> list[StoredMessage]:
        groups = exchanges(candidates)
        start = context.previous_first_id
        if start is not None:  # resume where the previous prompt started
            groups = [g for g in groups if g[-1].id >= start]
        costs = [self.cost(context, g) for g in groups]
        if sum(costs) > min(tokens_of(self.high, context.budget), budget):
            target = min(tokens_of(self.low, context.budget), budget)
            while groups and sum(costs) > target:
                groups.pop(0)
                costs.pop(0)
        return flatten(groups)
