"""The web's hints to the router: a turn will break its session's prefix (the router may then move it for
free), or its session is new (it is placed without a read)."""

import pytest

from chatapp.memory.registry import strategy_options
from chatapp.models import Turn
from chatapp.turns import admission
from chatapp.turns.admission import RouteHints, latest_turn, route_hints
from router.services import ServedModel
from tests.factories import ConversationFactory, MessageFactory
from tests.helpers import wait_for_turn

DROP_AT = {"high": 500, "low": 200}
SERVED = ServedModel(  # a 4,096-token context
    model="", model_path="", chat_template="chatml", n_ctx=4096, max_reply_tokens=256
)


def hints(conversation) -> RouteHints:
    return route_hints(conversation, SERVED, latest_turn(conversation))


def done_turn(
    conversation, *, verbatim: list[int], reply: int, strategy="stable_prefix", options=DROP_AT, status="done"
) -> Turn:
    """A finished turn as the node records it: its options resolved (the alias's, then the overrides)."""
    message = MessageFactory.create(conversation=conversation)
    segments = [{"kind": "system", "ids": [], "tokens": 300}]
    segments += [{"kind": "verbatim", "ids": [], "tokens": n} for n in verbatim]
    return Turn.objects.create(
        conversation=conversation,
        user_message=message,
        status=status,
        strategy=strategy,
        strategy_options=strategy_options(strategy, options),
        trace={"segments": segments},
        completion_tokens=reply,
    )


def test_a_stable_prefix_conversation_breaks_when_its_history_passes_the_drop_point(db):
    conversation = ConversationFactory.create(strategy="stable_prefix", strategy_options=DROP_AT)
    assert hints(conversation) == RouteHints(new=True, cold=False)  # no turn yet: nothing to lose
    turn = done_turn(conversation, verbatim=[250, 150], reply=90)
    # 490 tokens of history: the system prompt does not count
    assert hints(conversation) == RouteHints(new=False, cold=False)
    Turn.objects.filter(pk=turn.pk).update(completion_tokens=120)
    assert hints(conversation).cold  # 520 > 500: the next prompt drops a chunk


def test_a_conversation_on_its_strategys_own_options_keeps_its_prefix(db):
    """The API's and the browser's conversations override nothing: their turns record the alias's options,
    which is the same strategy (each follow-up had read as cold, and moved off a node that held it)."""
    conversation = ConversationFactory.create(strategy="stable_prefix", strategy_options={})
    turn = done_turn(conversation, verbatim=[250, 150], reply=90, options={})
    assert turn.strategy_options == strategy_options("stable_prefix") != {}
    assert hints(conversation) == RouteHints(new=False, cold=False)
    conversation.strategy_options = {"high": 3000}
    assert hints(conversation).cold  # other options: another prompt


@pytest.mark.django_db(transaction=True)
def test_a_turn_a_real_node_ran_leaves_its_follow_up_warm(node):
    """The node records the turn's options, the web reads them back: one conversation on the default
    strategy, end to end."""
    conversation = ConversationFactory.create()
    turn = wait_for_turn(admission.turn_start(conversation=conversation, text="My sister keeps goats."))
    assert turn.status == Turn.Status.DONE, turn.error
    assert turn.strategy_options == strategy_options(conversation.strategy) != conversation.strategy_options
    assert hints(conversation) == RouteHints(new=False, cold=False)


def test_a_changed_strategy_breaks_and_a_strategy_that_cannot_tell_never_does(db):
    conversation = ConversationFactory.create(strategy="window")
    done_turn(conversation, verbatim=[5000], reply=90, strategy="window", options={})
    assert not hints(conversation).cold
    conversation.strategy = "stable_prefix"
    assert hints(conversation).cold


def test_a_failed_or_cancelled_latest_turn_leaves_the_hints_to_the_latest_done_one(db):
    conversation = ConversationFactory.create(strategy="stable_prefix", strategy_options=DROP_AT)
    done_turn(conversation, verbatim=[250, 150], reply=120)  # 520: due for a drop
    done_turn(conversation, verbatim=[10], reply=1, status=Turn.Status.FAILED)
    assert hints(conversation) == RouteHints(new=False, cold=True)
    done_turn(conversation, verbatim=[10], reply=1, status=Turn.Status.CANCELLED)
    assert hints(conversation) == RouteHints(new=False, cold=True)


def test_a_conversation_whose_turns_all_failed_is_new_to_the_router(db):
    conversation = ConversationFactory.create(strategy="stable_prefix", strategy_options=DROP_AT)
    done_turn(conversation, verbatim=[250, 150], reply=120, status=Turn.Status.FAILED)
    assert hints(conversation) == RouteHints(new=True, cold=False)
