"""Memory strategies on the real tokenizer: each one's contract, properties over random conversations,
and how often each breaks the prompt's prefix (the node's cache) over a long conversation."""

from typing import Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chatapp.memory.base import (
    ContextOverflow,
    MemoryContext,
    MemoryStrategy,
    StoredMessage,
    StoredSummary,
    current_summaries,
)
from chatapp.memory.registry import strategy_get
from chatapp.memory.strategies import Full, StablePrefix, TokenBudget, Window
from inference.chat_format import ChatFormat

Role = Literal["user", "assistant"]

WORDS = "the sea was calm and my sister lives in Nairobi where we walked by a river all day long".split()  # noqa: SIM905


@pytest.fixture(scope="module")
def fmt(chat_format: ChatFormat) -> ChatFormat:
    return chat_format


def history(fmt: ChatFormat, exchanges: int, words: int = 12) -> list[StoredMessage]:
    messages = []
    for i in range(2 * exchanges):
        text = " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words)) + f" ({i})"
        role: Role = "user" if i % 2 == 0 else "assistant"
        token_ids = tuple(fmt.text_tokens(text)) if role == "assistant" else None
        messages.append(StoredMessage(id=i + 1, role=role, text=text, token_ids=token_ids))
    return messages


def context(fmt, messages, *, budget=3000, text="What should we do next?", **kwargs) -> MemoryContext:
    new = StoredMessage(id=len(messages) + 1, role="user", text=text)
    return MemoryContext(history=messages, new_message=new, budget=budget, count_tokens=fmt.count, **kwargs)


def rendered_tokens(fmt: ChatFormat, prompt) -> list[int]:
    return fmt.render(prompt.messages())


# Contracts ---------------------------------------------------------------------


def test_full_keeps_everything_and_says_when_it_no_longer_fits(fmt):
    messages = history(fmt, 5)
    prompt = Full().assemble(context(fmt, messages))
    assert prompt.kept_ids == tuple(range(1, 12)) and prompt.dropped_ids == ()
    assert len(rendered_tokens(fmt, prompt)) == prompt.tokens + fmt.overhead_of(prompt.messages())
    with pytest.raises(ContextOverflow, match=r"only \d+ fit in the model's context"):
        Full().assemble(context(fmt, messages, budget=60))


def test_window_keeps_the_last_exchanges(fmt):
    prompt = Window(exchanges=2).assemble(context(fmt, history(fmt, 5)))
    assert prompt.kept_ids == (7, 8, 9, 10, 11)
    assert prompt.dropped_ids == (1, 2, 3, 4, 5, 6)


def test_token_budget_keeps_the_newest_within_budget_and_always_the_system_prompt(fmt):
    messages = history(fmt, 8)
    prompt = TokenBudget(history_tokens=120).assemble(context(fmt, messages, system_prompt="You are kind."))
    verbatim = next(s for s in prompt.segments if s.kind == "verbatim")
    assert verbatim.tokens <= 120
    assert prompt.segments[0].kind == "system"
    assert prompt.kept_ids[-2] == 16  # the newest history message is kept


def test_pinned_messages_and_facts_ride_right_after_the_system_prompt(fmt):
    messages = history(fmt, 6)
    messages[0] = StoredMessage(id=1, role="user", text="My sister lives in Nairobi.", pinned=True)
    strategy = Window(exchanges=1, pinned=True)
    prompt = strategy.assemble(context(fmt, messages, system_prompt="Be brief.", facts=["I am allergic to cats."]))
    assert [s.kind for s in prompt.segments][:2] == ["system", "pinned"]
    pinned_text = prompt.segments[1].messages[0].text
    assert "Nairobi" in pinned_text and "allergic to cats" in pinned_text
    assert 1 in prompt.kept_ids


def test_excluded_messages_are_never_sent(fmt):
    messages = history(fmt, 3)
    messages[2] = StoredMessage(id=3, role="user", text="secret plan", excluded=True)
    prompt = Full().assemble(context(fmt, messages))
    assert 3 not in prompt.kept_ids and 3 in prompt.dropped_ids
    assert all("secret plan" not in m.text for m in prompt.messages())


def test_retrieval_brings_back_a_dropped_message_that_matches(fmt):
    messages = history(fmt, 8)
    messages[0] = StoredMessage(id=1, role="user", text="My sister lives in Nairobi.")

    def search(query: str, ids) -> list[int]:  # the real one is Postgres full-text search (test_memory_assembly)
        return [i for i in ids if messages[i - 1].text.startswith("My sister") and "sister" in query]

    strategy = Window(exchanges=1, retrieve=2)
    prompt = strategy.assemble(context(fmt, messages, text="Where does my sister live?", search=search))
    assert prompt.retrieved_ids == (1,)
    assert [s.kind for s in prompt.segments][-2:] == ["retrieved", "verbatim"]  # right before the new message


def test_summary_uses_the_stored_summaries_before_the_window_and_never_asks_for_one(fmt):
    messages = history(fmt, 12)
    strategy = StablePrefix(high=200, low=100, summarize=True)
    unsummarised = strategy.assemble(context(fmt, messages))  # nothing stored yet: old turns are just dropped
    assert unsummarised.dropped_ids and "summary" not in [s.kind for s in unsummarised.segments]
    through = (unsummarised.first_verbatim_id or 0) - 1
    summary = StoredSummary("They talked about rivers.", through_message_id=through, first_message_id=1)
    prompt = strategy.assemble(context(fmt, messages, summaries=[summary]))
    kinds = [s.kind for s in prompt.segments]
    assert kinds.index("summary") < kinds.index("verbatim")
    assert set(prompt.summarized_ids) == set(range(1, through + 1))


def test_a_roll_up_replaces_the_summaries_it_folds(fmt):
    chunks = [StoredSummary("rivers", 4, 1), StoredSummary("mountains", 8, 5)]
    rollup = StoredSummary("rivers and mountains", 8, 1)
    assert current_summaries([*chunks, rollup]) == [rollup]
    assert current_summaries([*chunks, rollup, StoredSummary("the sea", 12, 9)])[-1].text == "the sea"
    prompt = StablePrefix(high=200, low=100, summarize=True).assemble(
        context(fmt, history(fmt, 12), summaries=[*chunks, rollup])
    )
    summary_texts = [m.text for s in prompt.segments if s.kind == "summary" for m in s.messages]
    assert summary_texts == ["Summary of earlier conversation: rivers and mountains"]


def test_stable_prefix_rejects_inverted_watermarks():
    with pytest.raises(ValueError, match="low <= high"):
        StablePrefix(high=100, low=200)


# Properties ----------------------------------------------------------------------

ALIASES = ["full", "window", "token_budget", "stable_prefix", "retrieval", "pinned", "recall", "recall_cached"]
random_message = st.tuples(st.integers(1, 40), st.booleans(), st.booleans())  # words, pinned, excluded


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    alias=st.sampled_from(ALIASES),
    shape=st.lists(random_message, max_size=40),
    budget=st.integers(100, 3000),
)
def test_every_strategy_fits_is_deterministic_keeps_order_and_honours_flags(fmt, alias, shape, budget):
    messages = []
    for i, (words, pinned, excluded) in enumerate(shape):
        text = " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(words))
        role: Role = "user" if i % 2 == 0 else "assistant"
        messages.append(StoredMessage(id=i + 1, role=role, text=text, pinned=pinned, excluded=excluded))
    strategy: MemoryStrategy = strategy_get(alias)
    ctx = context(fmt, messages, budget=budget, facts=["I like tea."], search=lambda q, ids: sorted(ids)[:3])
    try:
        prompt = strategy.assemble(ctx)
    except ContextOverflow as exc:
        # Only `full` refuses because of history; any strategy refuses when what must be sent cannot fit.
        assert alias == "full" or "before any history" in str(exc)
        return
    assert prompt == strategy.assemble(ctx)  # deterministic
    assert prompt.tokens <= budget
    assert len(rendered_tokens(fmt, prompt)) == prompt.tokens + fmt.overhead_of(prompt.messages())  # exact accounting
    for segment in prompt.segments:
        assert list(segment.message_ids) == sorted(segment.message_ids)  # order preserved
    excluded = {m.id for m in messages if m.excluded}
    assert not excluded & set(prompt.kept_ids)
    if strategy.pinned:
        assert {m.id for m in messages if m.pinned and not m.excluded} <= set(prompt.kept_ids)


# Prefix stability over a long conversation ------------------------------------------


def count_prefix_breaks(fmt: ChatFormat, strategy: MemoryStrategy, exchanges: int) -> tuple[int, int]:
    """Replay a conversation turn by turn; a break is a prompt that does not extend the previous prompt + reply."""
    messages = history(fmt, exchanges, words=20)
    breaks, previous, first_id = 0, None, None
    for turn in range(exchanges):
        past, user = messages[: 2 * turn], messages[2 * turn]
        ctx = MemoryContext(
            history=past, new_message=user, budget=3000, count_tokens=fmt.count, previous_first_id=first_id
        )
        prompt = strategy.assemble(ctx)
        tokens = rendered_tokens(fmt, prompt)
        if previous is not None and tokens[: len(previous)] != previous:
            breaks += 1
        previous = tokens + list(messages[2 * turn + 1].token_ids or ())
        first_id = prompt.first_verbatim_id
    return breaks, exchanges


def test_stable_prefix_breaks_the_prefix_only_at_its_chunked_drops(fmt):
    stable_breaks, turns = count_prefix_breaks(fmt, StablePrefix(high=800, low=300), 60)
    window_breaks, _ = count_prefix_breaks(fmt, Window(exchanges=6), 60)
    total_tokens = fmt.count([m.chat() for m in history(fmt, 60, words=20)])
    assert stable_breaks <= total_tokens // (800 - 300) + 1
    assert window_breaks >= turns - 8  # a sliding window shifts the prefix every turn once full
    assert stable_breaks * 5 < window_breaks
