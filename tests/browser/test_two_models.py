"""A cluster serving two models: one real node per model, sessions sticky among their model's nodes,
`/v1/models` listing what is served, and a conversation of each model streaming in Chromium."""

import uuid
from collections.abc import Iterator

import openai
import pytest
from playwright.sync_api import Browser, expect

from chatapp.api.keys import api_key_create
from chatapp.models import Conversation, Message, Turn
from chatapp.turns import admission
from inference.model_files import DEFAULT_MODEL, resolve_model
from inference.tokenizer import chat_format_for
from router.models import AssignmentMove, Node, SessionAssignment
from router.services import healthy_nodes
from tests.browser.conftest import logged_in, shown_reply
from tests.conftest import start_node, stop_node
from tests.factories import ConversationFactory, UserFactory
from tests.helpers import only_these_nodes, wait_for_turn

pytestmark = pytest.mark.django_db(transaction=True)
SMOL, GEMMA = DEFAULT_MODEL, "gemma-3-270m"


@pytest.fixture(scope="module")
def two_models(test_database) -> Iterator[dict[str, str]]:
    """model -> node name: one node of each packaged model, one thread each as in the Procfile."""
    names = {SMOL: f"smol-{uuid.uuid4().hex[:6]}", GEMMA: f"gemma-{uuid.uuid4().hex[:6]}"}
    processes = [start_node(name, test_database, MODEL=model, N_THREADS="1") for model, name in names.items()]
    yield names
    for process in processes:
        stop_node(process)


@pytest.fixture
def nodes(two_models) -> dict[str, str]:
    only_these_nodes(*two_models.values())
    assert {n.name for n in healthy_nodes()} == set(two_models.values())
    return two_models


@pytest.fixture
def client(asgi_server, user) -> openai.OpenAI:
    key = api_key_create(owner=user, name="models")[1]
    return openai.OpenAI(base_url=f"{asgi_server}/v1", api_key=key, max_retries=0, timeout=120)


def test_each_node_registers_its_model_template_and_limits(nodes):
    smol, gemma = Node.objects.get(name=nodes[SMOL]), Node.objects.get(name=nodes[GEMMA])
    assert (smol.model, smol.chat_template, gemma.model, gemma.chat_template) == (SMOL, "chatml", GEMMA, "gemma")
    assert smol.n_ctx == gemma.n_ctx == 4096 and smol.max_reply_tokens == 24


def test_v1_models_lists_the_models_with_a_live_node(nodes, client):
    listed = {m.id: m for m in client.models.list()}
    assert set(listed) == {SMOL, GEMMA}
    assert listed[SMOL].max_model_len == 4096


def test_turns_go_to_their_models_node_and_stay_there(nodes):
    conversations = {model: ConversationFactory.create(model=model) for model in (SMOL, GEMMA)}
    for _ in range(2):
        for model, conversation in conversations.items():
            turn = wait_for_turn(admission.turn_start(conversation=conversation, text="Say hello."))
            assert turn.status == Turn.Status.DONE, turn.error
            assert turn.assistant_message is not None
            assert (turn.node, turn.model, turn.assistant_message.model) == (nodes[model], model, model)
    for model, conversation in conversations.items():
        second = conversation.turns.order_by("id").last()
        assert (
            second is not None and (second.cached_tokens or 0) > 0
        )  # the follow-up found its prefix on its model's node
        assert SessionAssignment.objects.get(session_key=conversation.session_key).node.name == nodes[model]


def test_switching_a_conversations_model_moves_it_and_retokenizes_the_replies(nodes):
    conversation = ConversationFactory.create(model=SMOL)
    first = wait_for_turn(admission.turn_start(conversation=conversation, text="Name a fruit."))
    assert first.status == Turn.Status.DONE, first.error
    conversation.model = GEMMA
    conversation.save(update_fields=["model"])
    second = wait_for_turn(admission.turn_start(conversation=conversation, text="And a vegetable?"))
    assert second.status == Turn.Status.DONE, second.error
    assert second.node == nodes[GEMMA]
    move = AssignmentMove.objects.get(session_key=conversation.session_key)
    assert (move.to_node, move.reason) == (nodes[GEMMA], "model changed")
    # SmolLM2's reply ids mean nothing to Gemma: the prompt holds the reply's text in Gemma's tokens instead.
    reply = first.assistant_message
    assert reply is not None and reply.model == SMOL
    prompt = second.prompt_token_ids or []
    in_gemma = chat_format_for(resolve_model(name=GEMMA)).text_tokens(reply.content.strip())
    assert any(prompt[i : i + len(in_gemma)] == in_gemma for i in range(len(prompt)))


def test_the_api_model_field_picks_the_model(nodes, client, user):
    for model in (SMOL, GEMMA):
        reply = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Hi!"}],
            max_tokens=8,
            temperature=0,
            extra_headers={"X-Session-ID": f"pick-{model}"},
        )
        assert reply.model == model and reply.choices[0].message.content
        conversation = Conversation.objects.get(owner=user, api_session__endswith=f"pick-{model}")
        assert conversation.model == model
        assert conversation.turns.get().node == nodes[model]


def test_an_unknown_model_is_404_and_a_model_without_a_live_node_is_503(nodes, client, user):
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "Hi"}])
    assert unknown.value.code == "model_not_found"
    Node.objects.filter(name=nodes[GEMMA]).update(status=Node.Status.DOWN)
    try:
        with pytest.raises(openai.APIStatusError) as down:
            client.chat.completions.create(model=GEMMA, messages=[{"role": "user", "content": "Hi"}])
        assert down.value.status_code == 503 and int(down.value.response.headers["Retry-After"]) > 0
        assert GEMMA not in {m.id for m in client.models.list()}
        assert not Message.objects.filter(conversation__owner=user).exists()
    finally:
        Node.objects.filter(name=nodes[GEMMA]).update(status=Node.Status.UP)


def test_a_conversation_of_each_model_streams_in_chromium(nodes, browser: Browser, asgi_server):
    UserFactory.create(username="two-models")
    page = logged_in(browser, asgi_server, "two-models")
    for model in (SMOL, GEMMA):
        page.goto("/")
        page.select_option("select[name=model]", model)
        page.click("text=New conversation")
        expect(page.locator("select[name=model] option[selected]")).to_have_attribute("value", model)
        page.fill("#composer textarea", "Hi! My name is Priya.")
        page.press("#composer textarea", "Enter")
        expect(page.locator(".msg.assistant:not(.pending)").last).to_be_visible(timeout=60_000)
        turn = Turn.objects.filter(conversation__owner__username="two-models").latest("id")
        assert (turn.status, turn.model, turn.node) == (Turn.Status.DONE, model, nodes[model])
        text = page.locator(".msg.assistant:not(.pending) .text").last.text_content()
        assert turn.assistant_message is not None and text == shown_reply(turn.assistant_message.content)
    page.context.close()
