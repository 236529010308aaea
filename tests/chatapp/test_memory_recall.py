"""The `recall` add-on on the real tokenizer: BM25 ranking, the recalled block and how it stays in later
prompts, and the summary step's chunks and roll-ups."""

import itertools
from dataclasses import replace
from datetime import UTC, datetime, timedelta

import pytest

from chatapp.memory import lexical
from chatapp.memory.base import MemoryContext, StoredMessage, StoredSummary
from chatapp.memory.strategies import StablePrefix
from chatapp.memory.summaries import ROLLUP_TOKENS, SummaryJob, rollup_job, summary_jobs
from inference.chat_format import ChatFormat

START = datetime(2024, 3, 1, 9, 0, tzinfo=UTC)
TOPICS = [
    "the traffic on the ring road was slow again",
    "we cooked a lentil soup with too much salt",
    "the football match ended in a draw",
    "the new phone battery drains by noon",
    "my neighbour is painting his fence green",
]


@pytest.fixture(scope="module")
def fmt(chat_format: ChatFormat) -> ChatFormat:
    return chat_format


def chat_history(exchanges: int, facts: dict[int, str]) -> list[StoredMessage]:
    """Small talk, a day per exchange, with `facts` said by the user at the exchanges given."""
    messages = []
    for i in range(exchanges):
        when = START + timedelta(days=i)
        text = facts.get(i, f"Today {TOPICS[i % len(TOPICS)]} ({i}).")
        messages.append(StoredMessage(2 * i + 1, "user", text, sent_at=when))
        messages.append(StoredMessage(2 * i + 2, "assistant", f"I see, tell me more ({i}).", sent_at=when))
    return messages


def test_terms_drop_function_words_and_stem():
    assert lexical.terms("Where does my sister live? She's living in Nairobi!") == (
        "sister",
        "live",
        "shes",
        "live",
        "nairobi",
    )


def test_rank_puts_the_matching_turn_first_and_lifts_its_neighbours():
    documents = [
        lexical.Document(1, "User: the ferry to the island was late", group="day 1"),
        lexical.Document(2, "Assistant: that is annoying", group="day 1"),
        lexical.Document(3, "User: my sister moved to Nairobi", group="day 2"),
        lexical.Document(4, "Assistant: how exciting, when?", group="day 2"),
        lexical.Document(5, "User: I bought bread", group="day 3"),
    ]
    ranked = lexical.rank("Where does my sister live now, Nairobi?", documents, neighbors=0.3, session=0.5)
    assert ranked[:2] == [3, 4]  # the match, then its neighbour in the same session
    assert 5 not in ranked and 1 not in ranked  # nothing shared, nothing lifted
    assert lexical.rank("the of and", documents, neighbors=0.3, session=0.5) == []


def test_rank_lifts_the_turns_of_the_speaker_a_question_names():
    documents = [
        lexical.Document(1, "I love painting", group=1, speaker="Caroline"),
        lexical.Document(2, "I love pottery", group=2, speaker="Melanie"),
    ]
    assert lexical.rank("What does Melanie love?", documents, neighbors=0, session=0, speaker=0.2) == [2, 1]
    assert lexical.rank("What does Melanie love?", documents, neighbors=0, session=0, speaker=0) == [1, 2]


def test_the_recalled_block_quotes_the_evidence_with_names_and_dates(fmt):
    history = chat_history(40, {3: "My sister moved to Nairobi last spring."})
    question = StoredMessage(81, "user", "Where does my sister live?", sent_at=START + timedelta(days=41))
    context = MemoryContext(
        history=history,
        new_message=question,
        budget=600,
        count_tokens=fmt.count,
        names={"user": "Priya", "assistant": "Sam"},
    )
    prompt = StablePrefix(high=0.5, low=0.2, recall_tokens=0.3).assemble(context)
    assert 7 in prompt.recalled_ids and 7 in prompt.kept_ids and 7 not in prompt.dropped_ids
    [block] = [s for s in prompt.segments if s.kind == "recalled"]
    assert prompt.segments[-2] == block  # right before the new message
    assert block.tokens <= 180 and prompt.tokens <= 600
    assert "[4 March 2024]\nPriya: My sister moved to Nairobi last spring." in block.messages[0].text
    assert prompt.trace()["recalled"] == list(prompt.recalled_ids)


def test_recalled_blocks_stay_in_front_of_their_messages_so_prompts_only_grow(fmt):
    """Ask questions one after another: each prompt extends the previous prompt and reply token for token,
    except at the window's chunked drops, and each question's block is still there in the next prompt."""
    history = chat_history(60, {5: "My sister moved to Nairobi.", 9: "I work as a nurse at the clinic."})
    questions = ["Where does my sister live?", "What is my job?", "Did we cook soup?", "Who paints a fence?"] * 3
    strategy = StablePrefix(high=0.8, low=0.3, recall_tokens=0.2)
    recalled: dict[int, tuple[int, ...]] = {}
    previous: list[int] | None = None
    first_id = None
    breaks = 0
    for n, text in enumerate(questions):
        new = StoredMessage(200 + 2 * n, "user", text, sent_at=START + timedelta(days=70, minutes=n))
        context = MemoryContext(
            history=list(history),
            new_message=new,
            budget=900,
            count_tokens=fmt.count,
            previous_first_id=first_id,
            recalled=dict(recalled),
        )
        prompt = strategy.assemble(context)
        tokens = fmt.render(prompt.messages())
        assert len(tokens) == prompt.tokens + fmt.overhead <= 900 + fmt.overhead
        if previous is not None and tokens[: len(previous)] != previous:
            breaks += 1
        elif n:  # no drop: the previous question's block is still in this prompt
            assert set(recalled[new.id - 2]) <= set(prompt.kept_ids)
        reply = StoredMessage(new.id + 1, "assistant", f"Answer {n}.", tuple(fmt.text_tokens(f"Answer {n}.")))
        history += [new, reply]
        recalled[new.id] = prompt.recalled_ids
        previous = tokens + list(reply.token_ids or ())
        first_id = prompt.first_verbatim_id
    assert recalled[200] and 11 in recalled[200]  # the first question found the sister
    assert breaks <= len(questions) // 3


def test_summary_jobs_cover_what_lies_before_the_window_in_chunks_that_fit(fmt):
    history = chat_history(50, {})

    def count(text: str) -> int:
        return len(fmt.text_tokens(text))

    jobs = summary_jobs(history=history, window_start=81, summaries=[], count_text=count, chunk_tokens=200)
    assert len(jobs) > 2
    assert jobs[0].first_message_id == 1 and jobs[-1].through_message_id == 80
    assert all(count(job.transcript) <= 200 for job in jobs)
    assert all(a.through_message_id + 1 == b.first_message_id for a, b in itertools.pairwise(jobs))
    covered = [StoredSummary("...", jobs[0].through_message_id, 1)]
    later = summary_jobs(history=history, window_start=81, summaries=covered, count_text=count, chunk_tokens=200)
    assert later[0].first_message_id == jobs[0].through_message_id + 1  # what is summarised is not again
    assert summary_jobs(history=history, window_start=1, summaries=[], count_text=count) == []


def test_a_roll_up_folds_the_summaries_once_they_pass_their_share(fmt):
    def count(text: str) -> int:
        return len(fmt.text_tokens(text))

    small = [StoredSummary("They talked about rivers.", 10, 1), StoredSummary("And about mountains.", 20, 11)]
    assert rollup_job(small, count) is None
    long_text = " ".join(["The user described a long trip through many towns and rivers."] * 20)
    large = [StoredSummary(long_text, 10, 1), StoredSummary(long_text, 20, 11)]
    assert count(long_text) * 2 > ROLLUP_TOKENS
    job = rollup_job(large, count, chunk_tokens=300)
    assert isinstance(job, SummaryJob) and (job.first_message_id, job.through_message_id) == (1, 20)
    assert count(job.transcript) <= 300


def test_recall_quotes_earlier_sittings_not_the_one_going_on(fmt):
    history = chat_history(30, {2: "My sister moved to Nairobi."})
    now = START + timedelta(days=40)
    asked = StoredMessage(61, "user", "Is my sister still in Nairobi?", sent_at=now - timedelta(minutes=5))
    answer = StoredMessage(62, "assistant", "Yes, your sister lives in Nairobi.", sent_at=now - timedelta(minutes=4))
    question = StoredMessage(63, "user", "Where does my sister live?", sent_at=now)
    strategy = StablePrefix(high=0, low=0, recall_tokens=1.0)  # no window: what is sent is recalled

    def recalled(gap: float) -> tuple[int, ...]:
        context = MemoryContext(
            history=[*history, asked, answer], new_message=question, budget=600, count_tokens=fmt.count
        )
        return replace(strategy, recall_gap_minutes=gap).assemble(context).recalled_ids

    assert 5 in recalled(60) and not {61, 62} & set(recalled(60))  # five minutes ago is this sitting
    assert {5, 61, 62} <= set(recalled(0))  # with no sittings, anything not in the prompt may come back


def test_a_message_excluded_after_it_was_recalled_is_no_longer_quoted(fmt):
    history = chat_history(30, {2: "My sister moved to Nairobi."})
    question = StoredMessage(61, "user", "Where does my sister live?", sent_at=START + timedelta(days=40))
    reply = StoredMessage(62, "assistant", "In Nairobi.", sent_at=START + timedelta(days=40))
    later = StoredMessage(63, "user", "Thanks!", sent_at=START + timedelta(days=40, minutes=1))
    strategy = StablePrefix(high=0.9, low=0.5, recall_tokens=0.3)

    def prompt(messages: list[StoredMessage]):
        context = MemoryContext(
            history=[*messages, question, reply],
            new_message=later,
            budget=900,
            count_tokens=fmt.count,
            previous_first_id=41,
            recalled={61: (5,)},
        )
        return strategy.assemble(context)

    assert 5 in prompt(history).kept_ids  # the block rides in front of its question
    excluded = [replace(m, excluded=True) if m.id == 5 else m for m in history]
    assert 5 not in prompt(excluded).kept_ids
