"""The assembly bridge with stored state: Postgres full-text retrieval and model-written summaries."""

import pytest

from chatapp.memory.assembly import turn_prompt, turn_record_prompt
from chatapp.models import Message, Summary, Turn
from chatapp.selectors import message_search
from inference.engine import Sampling
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
    return Turn.objects.create(conversation=conversation, user_message=question, strategy=strategy)


def test_the_summary_strategy_has_the_model_summarise_dropped_turns_and_records_the_cost(db, engine, settings):
    settings.CHAT_MEMORY_STRATEGIES = {
        "tiny_summary": {
            "BACKEND": "chatapp.memory.strategies.StablePrefix",
            "OPTIONS": {"high": 200, "low": 80, "summarize": True},
        }
    }
    turn = _conversation_with_turn("tiny_summary", exchanges=8)
    prompt = turn_prompt(turn=turn, engine=engine, sampling=SHORT)

    summary = Summary.objects.get(conversation=turn.conversation)
    assert summary.text and summary.completion_tokens > 0 and summary.ms > 0
    assert prompt.summary_cost == {
        "prompt_tokens": summary.prompt_tokens,
        "completion_tokens": summary.completion_tokens,
        "ms": round(summary.ms, 1),
    }
    kinds = [s.kind for s in prompt.assembled.segments]
    assert kinds.index("summary") < kinds.index("verbatim")
    assert summary.through_message_id == max(prompt.assembled.summarized_ids)

    turn_record_prompt(turn=turn, prompt=prompt, detokenize=engine.chat_format.display)
    turn.refresh_from_db()
    assert turn.trace["summary_cost"]["completion_tokens"] == summary.completion_tokens
    assert turn.strategy_options == {"high": 200, "low": 80, "summarize": True}
    assert "<start_of_turn>user" in turn.prompt_text and len(turn.prompt_hash) == 32
    assert len(prompt.tokens) == prompt.assembled.tokens + engine.chat_format.overhead

    again = turn_prompt(turn=turn, engine=engine, sampling=SHORT)
    assert Summary.objects.filter(conversation=turn.conversation).count() == 1  # nothing new to fold in
    assert again.tokens == prompt.tokens


@pytest.mark.parametrize("alias", ["full", "window", "token_budget", "stable_prefix", "retrieval", "pinned"])
def test_every_configured_strategy_assembles_a_stored_conversation(db, engine, alias):
    turn = _conversation_with_turn(alias, exchanges=4)
    prompt = turn_prompt(turn=turn, engine=engine, sampling=SHORT)
    assert prompt.assembled.kept_ids[-1] == turn.user_message_id
    assert len(prompt.tokens) == prompt.assembled.tokens + engine.chat_format.overhead
