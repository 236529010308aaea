"""The browser pages through Django's test client: chatting, bad input, and isolation between users."""

import subprocess
import sys
import time
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.urls import reverse

from chatapp.models import Conversation, Message, Turn, UserFact
from chatapp.turns import admission
from chatapp.validation import TurnRejected
from tests.factories import ConversationFactory, UserFactory
from tests.helpers import wait_for_turn

HTMX = {"HTTP_HX_REQUEST": "true"}


@async_to_sync
async def read_stream(response) -> str:
    return b"".join([chunk async for chunk in response.streaming_content]).decode()


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
    events_url = reverse("chat:turn_events", args=[conversation.pk, turn.pk])
    assert f'data-events="{events_url}"' in page
    assert "disabled" in page  # the composer waits for the reply

    wait_for_turn(turn)
    response = client.get(reverse("chat:turn_detail", args=[conversation.pk, turn.pk]), **HTMX)
    fragment = response.content.decode()
    assert "data-events" not in fragment  # finished: nothing more to stream
    assert 'hx-swap-oob="outerHTML"' in fragment  # the composer comes back enabled

    # The event stream replays from any entry: all of it from the start, nothing after its end.
    events = read_stream(client.get(events_url + "?after=0-0"))
    assert events.count("event: start") == 1 and events.count("event: done") == 1
    last_id = events.split("id: ")[-1].split("\n")[0]
    assert client.get(events_url, HTTP_LAST_EVENT_ID=last_id).status_code == 204
    assert client.get(events_url + "?after=not-an-id").status_code == 400

    page = client.get(reverse("chat:conversation_detail", args=[conversation.pk])).content.decode()
    reply = Message.objects.get(conversation=conversation, role=Message.Role.ASSISTANT)
    assert f'id="message-{reply.pk}"' in page
    assert "prompt tokens" in page

    # The follow-up reuses the first turn's tokens, and its inspector says from where.
    follow_up = wait_for_turn(admission.turn_start(conversation=conversation, text="And pears?"))
    assert follow_up.cache_source == Turn.CacheSource.RESIDENT
    page = client.get(reverse("chat:conversation_detail", args=[conversation.pk])).content.decode()
    assert f"{follow_up.cached_tokens} reused, resident in the node&#x27;s context;" in page


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


def test_another_users_conversation_is_404_on_every_url(client, user, other_user, idle_node):
    conversation = ConversationFactory.create(owner=user)
    turn = admission.turn_start(conversation=conversation, text="private")
    client.force_login(other_user)
    fact = UserFact.objects.create(owner=user, text="private fact")
    c, t, m = conversation.pk, turn.pk, turn.user_message_id
    gets = [
        reverse("chat:conversation_detail", args=[c]),
        reverse("chat:turn_detail", args=[c, t]),
        reverse("chat:turn_events", args=[c, t]),
    ]
    posts = [
        reverse("chat:turn_create", args=[c]),
        reverse("chat:turn_cancel", args=[c, t]),
        reverse("chat:turn_retry", args=[c, t]),
        reverse("chat:conversation_strategy", args=[c]),
        reverse("chat:message_flags", args=[c, m]),
        reverse("chat:fact_update", args=[fact.pk]),
        reverse("chat:fact_delete", args=[fact.pk]),
    ]
    for url in gets:
        assert client.get(url).status_code == 404, url
    for url in posts:
        assert client.post(url, {"text": "hijack"}).status_code == 404, url
    assert "private" not in client.get(reverse("chat:conversation_list")).content.decode()
    assert "private fact" not in client.get(reverse("chat:fact_list")).content.decode()
    assert Message.objects.count() == 1
    assert UserFact.objects.get(pk=fact.pk).text == "private fact"


def test_admin_shows_a_session_with_its_messages_and_turns(admin_client, idle_node):
    conversation = ConversationFactory.create()
    turn = admission.turn_start(conversation=conversation, text="inspect me")
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


def test_pin_exclude_and_switch_strategy(client, user, idle_node):
    client.force_login(user)
    conversation = ConversationFactory.create(owner=user, strategy="window")
    message = admission.turn_start(conversation=conversation, text="My sister lives in Nairobi.").user_message
    url = reverse("chat:message_flags", args=[conversation.pk, message.pk])
    response = client.post(url, {"action": "pin"}, **HTMX)
    assert response.status_code == 200 and "Unpin" in response.content.decode()
    client.post(url, {"action": "exclude"}, **HTMX)
    message.refresh_from_db()
    assert (message.pinned, message.excluded) == (True, True)
    assert client.post(url, {"action": "explode"}).status_code == 400

    strategy_url = reverse("chat:conversation_strategy", args=[conversation.pk])
    client.post(strategy_url, {"strategy": "summary"})
    conversation.refresh_from_db()
    assert conversation.strategy == "summary"
    response = client.post(strategy_url, {"strategy": "bogus"}, follow=True)
    assert "Unknown memory strategy &#x27;bogus&#x27;" in response.content.decode()
    conversation.refresh_from_db()
    assert conversation.strategy == "summary"


def test_saved_facts_add_edit_delete_and_remember_that(client, user, idle_node):
    client.force_login(user)
    client.post(reverse("chat:fact_list"), {"text": "I am allergic to <script>cats</script>"})
    fact = UserFact.objects.get(owner=user)
    page = client.get(reverse("chat:fact_list")).content.decode()
    assert "&lt;script&gt;cats&lt;/script&gt;" in page and "<script>cats" not in page
    client.post(reverse("chat:fact_update", args=[fact.pk]), {"text": "I am allergic to dogs"})
    fact.refresh_from_db()
    assert fact.text == "I am allergic to dogs"
    client.post(reverse("chat:fact_update", args=[fact.pk]), {"text": "   "})
    fact.refresh_from_db()
    assert fact.text == "I am allergic to dogs"  # an empty edit is refused, nothing lost
    client.post(reverse("chat:fact_delete", args=[fact.pk]))
    assert not UserFact.objects.exists()

    admission.turn_start(
        conversation=ConversationFactory.create(owner=user), text="Remember that my cat is called Miso."
    )
    assert list(UserFact.objects.values_list("text", flat=True)) == ["my cat is called Miso."]


def test_a_message_too_long_for_the_context_is_refused_before_it_is_stored(db, idle_node, settings):
    settings.CHAT_MAX_MESSAGE_CHARS = 100_000
    conversation = ConversationFactory.create()
    with pytest.raises(TurnRejected, match="does not fit the model's 4,096-token context"):
        admission.turn_start(conversation=conversation, text=" ".join(f"w{i}" for i in range(5000)))
    assert not Message.objects.exists()


def test_pages_carry_a_content_security_policy(client, user):
    client.force_login(user)
    policy = client.get(reverse("chat:conversation_list"))["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy and "unsafe-inline" not in policy


def test_turns_are_read_only_in_the_admin(client, db, idle_node):
    staff = UserFactory.create(is_staff=True, is_superuser=True)
    client.force_login(staff)
    turn = admission.turn_start(conversation=ConversationFactory.create(), text="look, don't touch")
    page = client.get(f"/admin/chatapp/turn/{turn.pk}/change/")
    assert page.status_code == 200 and "look, don" in page.content.decode()
    client.post(f"/admin/chatapp/turn/{turn.pk}/change/", {"status": "done", "node": "elsewhere"})
    turn.refresh_from_db()
    assert (turn.status, turn.node) == (Turn.Status.QUEUED, idle_node.name)
    assert client.get("/admin/chatapp/turn/add/").status_code == 403
