"""Raw HTTP against the API: malformed bodies, auth failures and limits, each in OpenAI's error format."""

import json

import pytest
from django.utils import timezone

from chatapp.api.keys import LAST_USED_RESOLUTION, api_key_create, api_key_find
from chatapp.models import ApiKey, Message, Turn
from chatapp.turns import lifecycle
from inference.model_files import DEFAULT_MODEL
from router.models import Node
from tests.helpers import generation

URL = "/v1/chat/completions"
MODEL = DEFAULT_MODEL  # the idle node serves it


@pytest.fixture
def auth(user) -> dict:
    return {"HTTP_AUTHORIZATION": f"Bearer {api_key_create(owner=user, name='raw')[1]}"}


def post(client, body, **headers):
    data = body if isinstance(body, bytes | str) else json.dumps(body)
    return client.post(URL, data=data, content_type="application/json", **headers)


def error(response) -> dict:
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (b"{not json", None, "could not parse the JSON"),
        ([1, 2], None, "must be a JSON object"),
        ({"model": MODEL}, "messages", "non-empty array"),
        ({"model": MODEL, "messages": []}, "messages", "non-empty array"),
        (
            {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].role",
            "must be one of",
        ),
        (
            {"model": MODEL, "messages": [{"role": "assistant", "content": "x"}]},
            "messages",
            "last message",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content",
            "text parts",
        ),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 2}, "n", "n=1"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5},
            "stop",
            "up to 4",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            "max_tokens",
            "positive",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []},
            "tools",
            "Unsupported",
        ),
    ],
)
def test_malformed_requests_are_400_saying_what_is_wrong(client, auth, body, param, fragment):
    response = post(client, body, **auth)
    assert response.status_code == 400
    assert fragment in error(response)["message"] and error(response)["param"] == param
    assert not Message.objects.exists()


def test_missing_wrong_and_revoked_keys_are_401(client, user):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert post(client, body).status_code == 401
    assert post(client, body, HTTP_AUTHORIZATION="Bearer sk-chat-0000000000000000").status_code == 401
    row, key = api_key_create(owner=user, name="old")
    ApiKey.objects.filter(pk=row.pk).update(revoked_at=timezone.now())
    response = post(client, body, HTTP_AUTHORIZATION=f"Bearer {key}")
    assert response.status_code == 401 and error(response)["type"] == "authentication_error"
    assert len(row.hashed) == 64 and key not in str(ApiKey.objects.values_list().get(pk=row.pk))


def test_a_key_records_its_last_use_to_the_minute(user):
    row, key = api_key_create(owner=user, name="busy")
    first = api_key_find(key).last_used_at  # type: ignore[union-attr]
    assert first is not None and ApiKey.objects.get(pk=row.pk).last_used_at == first
    api_key_find(key)  # within the minute: no write
    assert ApiKey.objects.get(pk=row.pk).last_used_at == first
    earlier = timezone.now() - LAST_USED_RESOLUTION
    ApiKey.objects.filter(pk=row.pk).update(last_used_at=earlier)
    api_key_find(key)
    assert ApiKey.objects.get(pk=row.pk).last_used_at > earlier  # type: ignore[operator]


def test_a_prompt_longer_than_the_context_is_400_context_length_exceeded(client, auth, idle_node, settings):
    settings.CHAT_MAX_MESSAGE_CHARS = 100_000
    text = " ".join(f"w{i}" for i in range(5000))
    response = post(client, {"model": MODEL, "messages": [{"role": "user", "content": text}]}, **auth)
    assert response.status_code == 400 and error(response)["code"] == "context_length_exceeded"


def test_a_full_queue_is_429_with_retry_after(client, auth, idle_node, settings):
    settings.CHAT_QUEUE_PER_SLOT = 0
    response = post(client, {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, **auth)
    assert response.status_code == 429 and response["Retry-After"] == "2"
    assert error(response)["type"] == "rate_limit_error"
    assert not Message.objects.filter(role="user", content="hi", conversation__turns__isnull=False).exists()


def test_keys_are_made_and_revoked_in_the_ui(client, user):
    client.force_login(user)
    page = client.post("/keys/", {"name": "laptop"}).content.decode()
    row = ApiKey.objects.get(owner=user)
    assert f"{row.prefix}" in page and 'id="new-key"' in page
    assert "sk-chat-" not in client.get("/keys/").content.decode().split("<ul")[1].replace(row.prefix, "")
    client.post(f"/keys/{row.pk}/revoke/")
    row.refresh_from_db()
    assert row.revoked_at is not None


# Refused before anything is stored ---------------------------------------------------

HISTORY = [
    {"role": "user", "content": "My cat is called Miso."},
    {"role": "assistant", "content": "Miso is a lovely name."},
]


def stored() -> list[tuple[str, str]]:
    return list(Message.objects.order_by("id").values_list("role", "content"))


@pytest.mark.parametrize(
    ("message", "param", "code"),
    [
        ({"role": "system", "content": "be brief\x00"}, "messages[0].content", "invalid_characters"),
        ({"role": "developer", "content": "be\x1b[31m red"}, "messages[0].content", "invalid_characters"),
        ({"role": "system", "content": "x" * 8001}, "messages[0].content", "too_long"),
    ],
)
def test_every_roles_content_is_checked_before_anything_is_stored(client, auth, idle_node, message, param, code):
    body = {"model": MODEL, "messages": [message, *HISTORY, {"role": "user", "content": "hi"}]}
    response = post(client, body, **auth)
    assert response.status_code == 400 and (error(response)["param"], error(response)["code"]) == (param, code)
    assert stored() == []


def test_control_characters_in_a_resent_assistant_message_are_refused(client, auth, idle_node):
    history = [HISTORY[0], {"role": "assistant", "content": "Miso\x00"}, {"role": "user", "content": "hi"}]
    response = post(client, {"model": MODEL, "messages": history}, **auth)
    assert response.status_code == 400 and error(response)["param"] == "messages[1].content"
    assert stored() == []


def test_an_empty_user_message_after_history_is_400_and_stores_nothing(client, auth, idle_node):
    response = post(client, {"model": MODEL, "messages": [*HISTORY, {"role": "user", "content": " "}]}, **auth)
    assert response.status_code == 400 and error(response)["code"] == "invalid_message"
    assert stored() == []


@pytest.mark.parametrize("refusal", ["busy", "no_node", "in_progress", "quota"])
def test_a_refused_request_keeps_what_was_stored_before_and_adds_nothing(
    client, auth, user, idle_node, settings, refusal
):
    first = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "first"}]}
    assert post(client, first, **auth, HTTP_X_SESSION_ID="s1").status_code == 200  # queued; the idle node never runs it
    before = stored()
    assert before == [("user", "first")]
    if refusal == "busy":
        settings.CHAT_QUEUE_PER_SLOT = 0
    elif refusal == "no_node":
        idle_node.status = "down"
        idle_node.save(update_fields=["status"])
    elif refusal == "quota":
        settings.CHAT_USER_MAX_RUNNING_TURNS = 1
    # A new session (a new conversation and its resent history), or the first one's next message (its reply).
    session = "s1" if refusal == "in_progress" else "s2"
    earlier = [{"role": "user", "content": "first"}, HISTORY[1]] if refusal == "in_progress" else HISTORY
    body = {"model": MODEL, "messages": [*earlier, {"role": "user", "content": "second"}]}
    response = post(client, body, **auth, HTTP_X_SESSION_ID=session)
    expected = {"busy": 429, "no_node": 503, "in_progress": 409, "quota": 429}[refusal]
    assert response.status_code == expected, response.content
    if expected in {429, 503}:
        assert int(response["Retry-After"]) > 0
    assert stored() == before


def test_max_tokens_over_the_servers_cap_is_a_clear_400(client, auth, idle_node):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 600}
    response = post(client, body, **auth)
    assert response.status_code == 400
    assert error(response)["code"] == "max_tokens_too_large" and "at most 256" in error(response)["message"]
    assert stored() == []


def test_each_api_key_has_limits_of_its_own_within_its_owners(client, user, idle_node, settings):
    settings.CHAT_KEY_MAX_RUNNING_TURNS, settings.CHAT_USER_MAX_RUNNING_TURNS = 1, 2
    script, laptop = (f"Bearer {api_key_create(owner=user, name=name)[1]}" for name in ("script", "laptop"))
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    assert post(client, body, HTTP_AUTHORIZATION=script, HTTP_X_SESSION_ID="a").status_code == 200
    refused = post(client, body, HTTP_AUTHORIZATION=script, HTTP_X_SESSION_ID="b")
    assert refused.status_code == 429 and "This key has 1 replies" in error(refused)["message"]
    assert post(client, body, HTTP_AUTHORIZATION=laptop, HTTP_X_SESSION_ID="c").status_code == 200  # another key
    refused = post(client, body, HTTP_AUTHORIZATION=laptop, HTTP_X_SESSION_ID="d")
    assert refused.status_code == 429 and "You have 2 replies" in error(refused)["message"]  # the account's limit
    assert Turn.objects.filter(api_key__name="script").count() == 1


def test_the_same_request_sent_again_is_answered_by_its_turn_not_stored_twice(client, auth, idle_node):
    body = {"model": MODEL, "stream": True, "messages": [{"role": "user", "content": "Hello?"}]}
    assert post(client, body, **auth, HTTP_X_SESSION_ID="again").status_code == 200
    turn = Turn.objects.get()
    assert lifecycle.turn_fail(turn_id=turn.pk, attempt=0, error="the node fell over")
    assert post(client, body, **auth, HTTP_X_SESSION_ID="again").status_code == 200  # the client retries
    turn.refresh_from_db()
    assert (Turn.objects.count(), turn.status, turn.attempt) == (1, Turn.Status.QUEUED, 1)  # retried, not doubled
    assert stored() == [("user", "Hello?")]


def test_a_request_sent_again_after_its_node_restarted_is_answered_by_its_turn_sent_on(client, auth, idle_node):
    """The turn was claimed by a process the node's name no longer runs: the request sent again finds it
    unfinished, has it sent on (a new attempt) and is answered by it, without waiting for a heartbeat."""
    hello = [{"role": "user", "content": "Hello?"}]
    body = {"model": MODEL, "stream": True, "messages": hello}
    assert post(client, body, **auth, HTTP_X_SESSION_ID="restarted").status_code == 200
    turn = lifecycle.turn_claim(turn_id=Turn.objects.get().pk, attempt=0, node=idle_node.name, incarnation="old")
    assert turn is not None
    Node.objects.filter(pk=idle_node.pk).update(incarnation="new")
    assert post(client, body, **auth, HTTP_X_SESSION_ID="restarted").status_code == 200
    turn.refresh_from_db()
    assert (Turn.objects.count(), turn.status, turn.attempt) == (1, Turn.Status.QUEUED, 1)
    assert stored() == [("user", "Hello?")]

    follow_up = [*hello, {"role": "user", "content": "And then?"}]
    refused = post(client, body | {"messages": follow_up}, **auth, HTTP_X_SESSION_ID="restarted")
    assert refused.status_code == 409 and error(refused)["code"] == "reply_in_progress"  # it is being written


def test_a_follow_up_turn_starts_in_one_transaction_that_locks_its_conversation_once(
    client, auth, idle_node, django_assert_num_queries, settings
):
    """Every turn's request runs these statements before its first token: one more is a decision, not an accident."""
    settings.ROUTER_VIEW_SECONDS = 3600  # the nodes are read once for this process's routing, not per turn
    messages = [{"role": "user", "content": "Hello?"}]
    body = {"model": MODEL, "stream": True, "messages": messages}
    assert post(client, body, **auth, HTTP_X_SESSION_ID="counted").status_code == 200
    turn = lifecycle.turn_claim(turn_id=Turn.objects.get().pk, attempt=0, node=idle_node.name, incarnation="a")
    assert turn is not None and lifecycle.turn_finish(turn=turn, generation=generation("Hi."))
    messages += [{"role": "assistant", "content": "Hi."}, {"role": "user", "content": "How are you?"}]
    # The key; then in one transaction (here a savepoint and its release): the conversation locked, its
    # latest turn (sent again? a reply in progress? the route hints), its stored messages, 2 for the
    # quotas (the account's exemption or lock, then the replies it is writing), the session's node, that
    # node's queue, the message, the turn, the conversation's update time. Orphans are reaped only when
    # the latest turn is unfinished.
    with django_assert_num_queries(13) as captured:
        assert post(client, body, **auth, HTTP_X_SESSION_ID="counted").status_code == 200
    locks = [q["sql"] for q in captured.captured_queries if q["sql"].endswith("FOR UPDATE")]
    assert len(locks) == 1 and 'FROM "chatapp_conversation"' in locks[0]
    assert stored() == [("user", "Hello?"), ("assistant", "Hi."), ("user", "How are you?")]
