"""Every admin page of every model renders for a staff user, and no list costs a query per row."""

import pytest
from django.contrib import admin
from django.contrib.auth.models import Group
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from chatapp.api.keys import api_key_create
from chatapp.experiments.models import Experiment, ReplayTurn, Run
from chatapp.models import Summary, UserFact
from chatapp.turns import admission
from chatapp.turns.lifecycle import turn_fail
from router.services import ServedModel, assignment_move, node_heartbeat
from tests.factories import ConversationFactory, MessageFactory, NodeFactory, UserFactory

SERVED = ServedModel(model="", model_path="", chat_template="chatml", n_ctx=4096, max_reply_tokens=64)


def _one_of_everything(n: int) -> None:
    """A group, and a user with a conversation of two turns (one failed), a summary, a fact and a key; a session moved
    to a node of its own, with heartbeats kept; an experiment with a run and a replayed turn."""
    owner = UserFactory.create()
    Group.objects.create(name=f"group {n}")
    conversation = ConversationFactory.create(owner=owner)
    first = admission.turn_start(conversation=conversation, text=f"hello {n}")
    turn_fail(turn_id=first.pk, attempt=first.attempt, error="it broke")
    message = MessageFactory.create(conversation=conversation, content="later")
    Summary.objects.create(conversation=conversation, text="a summary", first_message=message, through_message=message)
    UserFact.objects.create(owner=owner, text=f"fact {n}")
    api_key_create(owner=owner, name=f"key {n}")
    node = NodeFactory.create()
    assignment_move(session_key=conversation.session_key, node_name=node.name)
    for _ in range(2):
        node_heartbeat(
            name=node.name,
            capacity=16,
            stats={"kv_cells_used": 10, "sessions": {conversation.session_key: "resident"}},
            incarnation="",
            served=SERVED,
            sample=True,
        )
    experiment = Experiment.objects.create(name=f"experiment {n}", source="chitchat")
    run = Run.objects.create(experiment=experiment, label="a", strategy="window")
    ReplayTurn.objects.create(run=run, session=0, index=0, status="done", turn=first)


@pytest.fixture
def everything(idle_node) -> None:
    _one_of_everything(0)


MODELS = list(admin.site._registry)


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m._meta.label)
def test_every_list_renders_with_as_many_queries_for_many_rows_as_for_one(admin_client, everything, model):
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    with CaptureQueriesContext(connection) as one:
        assert admin_client.get(url).status_code == 200
    for n in range(1, 4):
        _one_of_everything(n)
    assert model.objects.count() > 1
    with CaptureQueriesContext(connection) as many:
        assert admin_client.get(url).status_code == 200
    assert len(many) == len(one), [q["sql"] for q in many.captured_queries]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m._meta.label)
def test_every_page_of_a_record_renders(admin_client, everything, model):
    record = model.objects.first()
    change = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_change", args=[record.pk])
    assert admin_client.get(change).status_code == 200
    history = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_history", args=[record.pk])
    assert admin_client.get(history).status_code == 200
