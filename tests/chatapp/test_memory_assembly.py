"""The assembly bridge with stored state: Postgres full-text retrieval, model-written summaries after a turn."""

import pytest

from chatapp.memory.assembly import prompt_record, turn_prompt, turn_summarize
from chatapp.memory.summaries import SUMMARY_TOKENS
from chatapp.models import Message, Summary, Turn, UserFact
from chatapp.selectors import message_search
from chatapp.turns.lifecycle import turn_record_prompt
from inference.types import Sampling
from tests.factories import ConversationFactory, MessageFactory

SHORT = Sampling(max_tokens=16, temperature=0, top_p=1, repeat_penalty=1.1)


def test_full_text_search_finds_the_matching_dropped_message(db):
    conversation = ConversationFactory.create()
    sister = MessageFactory.create(conversation=conversation, content="My sister lives in Nairobi.")
    turtles = MessageFactory.create(conversation=conversation, content="I like turtles a lot.")
    assert message_search(query="Where does my sister live?", message_ids=[sister.pk, turtles.pk]) == [sister.pk]
    assert message_search(query="?!", message_ids=[sister.pk]) == []


def _conversation_with_turn(strategy: str, exchanges: int) -> Turn:
    conversation = ConversationFactory.create(strategy=strategy)
    for i in range(exchanges):
        MessageFactory.create(conversation=conversation, content=f"Day {i}: we walked along the river to the old mill.")
        MessageFactory.create(
            conversation=conversation, role=Message.Role.ASSISTANT, content=f"That sounds lovely ({i})."
        )
    question = MessageFactory.create(conversation=conversation, content="Where did we walk?")
    return Turn.objects.create(
        conversation=conversation, user_message=question, strategy=strategy, status=Turn.Status.RUNNING
    )


def test_summaries_are_written_after_the_turn_in_chunks_that_fit_then_used_by_the_next_prompt(
    transactional_db, engine, settings
):
    """Outside a transaction, as on the node: each summary is a model call between two statements, and the
    product's connections end a transaction left idle that long (DB_IDLE_IN_TRANSACTION_TIMEOUT_S)."""
    settings.CHAT_MEMORY_STRATEGIES = {
        "tiny_summary": {
            "BACKEND": "chatapp.memory.strategies.StablePrefix",
            "OPTIONS": {"high": 200, "low": 80, "summarize": True},
        }
    }
    turn = _conversation_with_turn("tiny_summary", exchanges=100)
    prompt = turn_prompt(turn=turn, engine=engine, sampling=SHORT)
    assert not Summary.objects.exists()  # assembling never calls the model
    assert prompt.assembled.dropped_ids and "summary" not in [s.kind for s in prompt.assembled.segments]
    assert turn_record_prompt(turn=turn, fields=prompt_record(turn, prompt, engine.chat_format))
    turn.refresh_from_db()
    assert turn.strategy_options == {"high": 200, "low": 80, "summarize": True}
    assert engine.chat_format.spec.open["user"] in turn.prompt_text and len(turn.prompt_hash) == 32

    written = turn_summarize(turn=turn, engine=engine)

    rows = list(Summary.objects.filter(conversation=turn.conversation).order_by("id"))
    assert len(rows) >= 2 and len(written) == len(rows)  # 100 exchanges do not fit one summarising prompt
    assert all(r.text and r.completion_tokens > 0 and r.ms > 0 for r in rows)
    assert all(r.prompt_tokens + SUMMARY_TOKENS <= engine.n_ctx for r in rows)  # each summarising prompt fits
    assert rows[0].first_message_id == min(prompt.assembled.dropped_ids)
    assert max(r.through_message_id for r in rows) == max(prompt.assembled.dropped_ids)

    again = turn_prompt(turn=turn, engine=engine, sampling=SHORT)
    kinds = [s.kind for s in again.assembled.segments]
    assert kinds.index("summary") < kinds.index("verbatim")
    assert set(again.assembled.summarized_ids) == set(prompt.assembled.dropped_ids)
    assert len(again.tokens) == again.assembled.tokens + engine.chat_format.overhead_of(again.assembled.messages())
    assert turn_summarize(turn=turn, engine=engine) == written  # nothing new to fold in
    assert Summary.objects.filter(conversation=turn.conversation).count() == len(rows)


@pytest.mark.parametrize(
    "alias", ["full", "window", "token_budget", "stable_prefix", "retrieval", "pinned", "recall", "recall_cached"]
)
def test_every_configured_strategy_assembles_a_stored_conversation(db, engine, alias):
    turn = _conversation_with_turn(alias, exchanges=4)
    prompt = turn_prompt(turn=turn, engine=engine, sampling=SHORT)
    assert prompt.assembled.kept_ids[-1] == turn.user_message_id
    assert len(prompt.tokens) == prompt.assembled.tokens + engine.chat_format.overhead_of(prompt.assembled.messages())


@pytest.mark.parametrize(("alias", "queries"), [("stable_prefix", 2), ("pinned", 3), ("summary", 3)])
def test_a_prompt_reads_the_users_facts_and_the_summaries_only_for_a_strategy_that_uses_them(
    db, engine, django_assert_num_queries, alias, queries
):
    """Two queries for every prompt (the history, the earlier turns' traces), one more for each add-on."""
    turn = _conversation_with_turn(alias, exchanges=4)
    UserFact.objects.create(owner=turn.conversation.owner, text="My sister lives in Nairobi.")
    with django_assert_num_queries(queries):
        prompt = turn_prompt(turn=turn, engine=engine, sampling=SHORT)
    pinned = [s for s in prompt.assembled.segments if s.kind == "pinned"]
    assert [s.messages[0].text for s in pinned] == (
        ["Things to remember:\n- My sister lives in Nairobi."] if alias == "pinned" else []
    )
