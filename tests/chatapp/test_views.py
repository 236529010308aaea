"""The browser pages through Django's test client: chatting, bad input, and isolation between users."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from django.urls import reverse

from chatapp import services
from chatapp.models import Conversation, Message, Turn
from tests.factories import ConversationFactory, UserFactory
from tests.helpers import wait_for_turn

HTMX = {"HTTP_HX_REQUEST": "true"}


@pytest.mark.django_db(transaction=True)
def test_log_in_create_a_conversation_and_chat(client, node):
    UserFactory.create(username="alice")
    response = client.post(reverse("login"), {"username": "alice", "password": "correct horse battery staple"})
    assert response.status_code == 302

    response = client.post(reverse("chat:conversation_create"), {"title": "Fruit talk"})
    conversation = Conversation.objects.get(title="Fruit talk")
    assert response["Location"] == reverse("chat:conversation_detail", args=[conversation.pk])

    response = client.post(
        reverse("chat:turn_create", args=[conversation.pk]), {"text": "Do you like <b>apples</b>?"}, **HTMX
    )
    assert response.status_code == 200
    page = response.content.decode()
    assert "Do you like &lt;b&gt;apples&lt;/b&gt;?" in page
    turn = Turn.objects.get(conversation=conversation)
    assert f'hx-get="{reverse("chat:turn_detail", args=[conversation.pk, turn.pk])}"' in page
    assert "disabled" in page  # the composer waits for the reply

    wait_for_turn(turn)
    response = client.get(reverse("chat:turn_detail", args=[conversation.pk, turn.pk]), **HTMX)
    fragment = response.content.decode()
    assert "hx-get" not in fragment.split('id="composer"')[0]  # finished: no more polling
    assert 'hx-swap-oob="outerHTML"' in fragment  # the composer comes back enabled

    page = client.get(reverse("chat:conversation_detail", args=[conversation.pk])).content.decode()
    reply = Message.objects.get(conversation=conversation, role=Message.Role.ASSISTANT)
    assert f'id="message-{reply.pk}"' in page
    assert "prompt tokens" in page


def test_a_refused_message_shows_why_and_stores_nothing(client, user):
    client.force_login(user)
    conversation = ConversationFactory.create(owner=user)
    response = client.post(reverse("chat:turn_create", args=[conversation.pk]), {"text": "   "}, **HTMX)
    assert response.status_code == 422
    assert "The message is empty." in response.content.decode()
    assert response["HX-Retarget"] == "#composer"
    assert not Message.objects.exists()


def test_pages_need_a_login(client, user):
    conversation = ConversationFactory.create(owner=user)
    response = client.get(reverse("chat:conversation_detail", args=[conversation.pk]))
    assert response.status_code == 302
    assert response["Location"].startswith(reverse("login"))


def test_another_users_conversation_is_404_on_every_url(client, user, other_user, settings):
    settings.ROUTER_NODES = ["nowhere"]
    conversation = ConversationFactory.create(owner=user)
    turn = services.turn_start(conversation=conversation, text="private")
    client.force_login(other_user)
    c, t = conversation.pk, turn.pk
    gets = [reverse("chat:conversation_detail", args=[c]), reverse("chat:turn_detail", args=[c, t])]
    posts = [reverse("chat:turn_create", args=[c]), reverse("chat:turn_cancel", args=[c, t])]
    for url in gets:
        assert client.get(url).status_code == 404, url
    for url in posts:
        assert client.post(url, {"text": "hijack"}).status_code == 404, url
    assert "private" not in client.get(reverse("chat:conversation_list")).content.decode()
    assert Message.objects.count() == 1


def test_admin_shows_a_session_with_its_messages_and_turns(admin_client, settings):
    settings.ROUTER_NODES = ["nowhere"]
    conversation = ConversationFactory.create()
    turn = services.turn_start(conversation=conversation, text="inspect me")
    conversation_url = reverse("admin:chatapp_conversation_change", args=[conversation.pk])
    turn_url = reverse("admin:chatapp_turn_change", args=[turn.pk])
    expectations = {
        conversation_url: "inspect me",  # the message inline
        turn_url: "inspect me",  # the user message it answers
        reverse("admin:chatapp_turn_changelist") + "?status=queued&q=inspect": turn_url,
        reverse("admin:chatapp_conversation_changelist") + "?q=inspect": conversation_url,
    }
    for url, expected in expectations.items():
        response = admin_client.get(url)
        assert response.status_code == 200, url
        assert expected in response.content.decode(), url


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("DATABASE_URL", "postgres://postgres@127.0.0.1:1/chatapp", "Postgres is not reachable at 127.0.0.1:1"),
        ("REDIS_URL", "redis://127.0.0.1:1/0", "Redis is not reachable at redis://127.0.0.1:1/0"),
    ],
)
def test_unreachable_services_fail_fast_with_one_line(variable, value, expected):
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "manage.py", "check_services"],
        env={"PATH": "/usr/bin:/bin", "DEBUG": "on", variable: value},
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0
    assert expected in result.stderr
    assert time.monotonic() - started < 30
