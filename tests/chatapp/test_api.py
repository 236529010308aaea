"""The OpenAI-compatible API through the official `openai` client, a live ASGI server and a real node."""

from typing import Any

import openai
import pytest
from django.conf import settings

from chatapp.api.keys import api_key_create
from chatapp.models import Conversation, Turn

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def api_key(user) -> str:
    return api_key_create(owner=user, name="tests")[1]


@pytest.fixture
def client(asgi_server, api_key, node) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{asgi_server}/v1", api_key=api_key, max_retries=0, timeout=120)


def ask(client: openai.OpenAI, messages: list[Any], **kwargs):
    return client.chat.completions.create(
        model=settings.CHAT_DEFAULT_MODEL, messages=messages, max_tokens=12, temperature=0, **kwargs
    )


def test_multi_turn_with_a_session_id_stores_history_once_and_reuses_the_cache(client, user):
    session = {"X-Session-ID": "trip-planning"}
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Plan a trip to Rome."}]
    first = ask(client, messages, extra_headers=session)
    assert first.object == "chat.completion" and first.id.startswith("chatcmpl-")
    assert first.choices[0].message.role == "assistant" and first.choices[0].message.content
    assert first.choices[0].finish_reason in {"stop", "length"}
    assert first.usage.prompt_tokens > 0 and first.usage.completion_tokens > 0

    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And Paris?"},
    ]
    second = ask(client, messages, extra_headers=session)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens

    conversation = Conversation.objects.get(owner=user)
    assert conversation.source == Conversation.Source.API and conversation.system_prompt == "You are terse."
    assert list(conversation.messages.values_list("role", flat=True)) == ["user", "assistant", "user", "assistant"]


def test_streaming_sends_chunks_a_finish_reason_and_usage(client, user):
    stream = ask(
        client, [{"role": "user", "content": "Name a colour."}], stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] in (
        ["stop"],
        ["length"],
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    reply = Turn.objects.get(conversation__owner=user).assistant_message
    assert reply is not None and reply.content == text


def test_a_stateless_client_lands_on_the_same_conversation_by_its_first_messages(client, user):
    messages = [{"role": "user", "content": "Hello there, who are you?"}]
    first = ask(client, messages)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Why?"},
    ]
    ask(client, messages)
    assert Conversation.objects.filter(owner=user).count() == 1
    # A different history for the same session branches into a new conversation.
    ask(client, [*messages[:1], {"role": "assistant", "content": "Something else."}, messages[2]])
    assert Conversation.objects.filter(owner=user).count() == 2


def test_the_memory_strategy_header_picks_the_strategy(client, user):
    ask(client, [{"role": "user", "content": "Hi"}], extra_headers={"X-Memory-Strategy": "window"})
    turn = Turn.objects.get(conversation__owner=user)
    assert turn.conversation.strategy == "window" and turn.strategy == "window"
    with pytest.raises(openai.BadRequestError, match=r"Unknown memory strategy 'bogus'.*stable_prefix"):
        ask(client, [{"role": "user", "content": "Hi"}], extra_headers={"X-Memory-Strategy": "bogus"})


def test_client_errors_come_back_as_openai_errors(client, asgi_server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    with pytest.raises(openai.BadRequestError, match="Unsupported parameter: 'logprobs'"):
        ask(client, [{"role": "user", "content": "Hi"}], logprobs=True)
    with pytest.raises(openai.BadRequestError, match=r"must be a number from 0\.0 to 2\.0"):
        client.chat.completions.create(
            model=settings.CHAT_DEFAULT_MODEL, messages=[{"role": "user", "content": "x"}], temperature=3
        )
    wrong = openai.OpenAI(base_url=f"{asgi_server}/v1", api_key="sk-chat-not-a-real-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert [m.id for m in client.models.list()] == [settings.CHAT_DEFAULT_MODEL]
