"""The counterfactual inspector: what every configured strategy would have sent for a turn equals a dry
run of the same conversation, the strategy used equals what the node did, and a broken cache is
explained by the segment and the cause."""

from datetime import timedelta

import pytest
from django.urls import reverse
from django.utils import timezone

from chatapp.counterfactual import cache_break, turn_counterfactual
from chatapp.experiments.replay import dry_turns
from chatapp.experiments.sources import ReplaySession
from chatapp.memory.assembly import prompt_record, turn_prompt
from chatapp.memory.registry import strategy_aliases, strategy_get
from chatapp.models import Message, Turn
from chatapp.turns import admission
from chatapp.turns.lifecycle import turn_record_prompt
from inference.config import EngineConfig
from inference.types import Sampling
from router.models import Node
from tests.factories import ConversationFactory, MessageFactory, NodeFactory
from tests.helpers import wait_for_turn

USER = [f"Day {i}: we walked along the river to the old mill and counted {i} herons." for i in range(14)]
REPLIES = [f"How lovely; {i} herons is a good count for the mill pond." for i in range(14)]


def _stored_conversation(fmt, **fields):
    """The exchanges stored as a chat would (replies with their tokens), a day apart, and the last turn."""
    conversation = ConversationFactory.create(**fields)
    start = timezone.now() - timedelta(days=30)
    for day, (text, reply) in enumerate(zip(USER, REPLIES, strict=True)):
        when = start + timedelta(days=day)
        user = MessageFactory.create(conversation=conversation, content=text, created_at=when)
        if day < len(USER) - 1:
            MessageFactory.create(
                conversation=conversation,
                role=Message.Role.ASSISTANT,
                content=reply,
                token_ids=fmt.text_tokens(reply),
                model=conversation.model,
                created_at=when + timedelta(seconds=5),
            )
    return Turn.objects.create(
        conversation=conversation,
        user_message=user,
        node="limits",
        model=conversation.model,
        strategy=conversation.strategy,
        status=Turn.Status.DONE,
    )


def test_every_strategys_figures_equal_a_dry_run_of_the_same_conversation(db, chat_format):
    config = EngineConfig()
    Node.objects.update(status=Node.Status.DOWN)
    NodeFactory.create(name="limits", n_ctx=config.N_CTX, max_reply_tokens=64)
    turn = _stored_conversation(chat_format)
    rows = {row.strategy: row for row in turn_counterfactual(turn)}
    assert list(rows) == strategy_aliases() and rows[turn.strategy].actual
    session = ReplaySession("same", tuple(USER), tuple(REPLIES))
    for alias in strategy_aliases():
        *_, last = dry_turns(strategy_get(alias), session, max_tokens=64)
        row = rows[alias]
        assert (row.prompt_tokens, row.prompt_tokens - row.computed_tokens) == (
            last["prompt_tokens"],
            last["cached_tokens"],
        ), alias
        assert len(row.dropped_ids) == last["dropped_messages"], alias
    assert any(row.computed_tokens < row.prompt_tokens for row in rows.values())  # some reuse the cache
    assert rows["full"].dropped_ids == ()


def test_the_strategy_used_matches_what_the_node_did(node, client, user):
    conversation = ConversationFactory.create(owner=user)
    for text in ("My sister lives in Porto.", "She keeps goats.", "How many goats, do you think?"):
        turn = wait_for_turn(admission.turn_start(conversation=conversation, text=text))
        assert turn.status == Turn.Status.DONE, turn.error
    used = next(row for row in turn_counterfactual(turn) if row.actual)
    assert (used.strategy, used.prompt_tokens, used.computed_tokens) == (
        turn.strategy,
        turn.prompt_tokens,
        turn.computed_tokens,
    )
    assert cache_break(turn) is None  # stable_prefix extended the previous prompt and reply whole
    client.force_login(user)
    page = client.get(reverse("chat:turn_what_if", args=[conversation.pk, turn.pk]), HTTP_HX_REQUEST="true")
    assert page.status_code == 200
    html = page.content.decode()
    assert "extended the previous prompt and reply whole" in html and f"<td>{turn.prompt_tokens}</td>" in html


test_the_strategy_used_matches_what_the_node_did = pytest.mark.django_db(transaction=True)(
    test_the_strategy_used_matches_what_the_node_did
)


def test_a_chunked_drop_is_named_as_the_cause_of_a_broken_cache(db, engine, settings):
    settings.CHAT_MEMORY_STRATEGIES = {
        "tiny": {"BACKEND": "chatapp.memory.strategies.StablePrefix", "OPTIONS": {"high": 260, "low": 120}}
    }
    conversation = ConversationFactory.create(strategy="tiny")
    sampling = Sampling(max_tokens=16, temperature=0, top_p=1, repeat_penalty=1)
    broken = []
    for text, reply in zip(USER, REPLIES, strict=True):
        question = MessageFactory.create(conversation=conversation, content=text)
        turn = Turn.objects.create(
            conversation=conversation, user_message=question, strategy="tiny", status=Turn.Status.RUNNING
        )
        prompt = turn_prompt(turn=turn, engine=engine, sampling=sampling)
        assert turn_record_prompt(turn=turn, fields=prompt_record(turn, prompt, engine.chat_format))
        answer = MessageFactory.create(
            conversation=conversation,
            role=Message.Role.ASSISTANT,
            content=reply,
            token_ids=engine.chat_format.text_tokens(reply),
            model=engine.model,
        )
        Turn.objects.filter(pk=turn.pk).update(
            status=Turn.Status.DONE, assistant_message=answer, prompt_tokens=len(prompt.tokens)
        )
        turn.refresh_from_db()
        if (found := cache_break(turn)) is not None:
            broken.append((turn, found))
    assert broken, "the tiny window never dropped a chunk"
    turn, found = broken[0]
    assert found.cause.startswith("a drop: ") and found.cause.endswith("left the prompt")
    assert found.segment == "verbatim" and 0 < found.at_token < found.previous_tokens
    previous = Turn.objects.get(pk=turn.pk - 1).prompt_token_ids or []
    assert (turn.prompt_token_ids or [])[: found.at_token] == previous[: found.at_token]
