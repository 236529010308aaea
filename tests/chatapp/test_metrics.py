"""/metrics in Prometheus' text format, from shared state (any web worker gives the same figures), and
the health probes. The counters are checked against a real turn on a real node."""

import http.client
import json
import time
from urllib.parse import urlsplit

import pytest
from django.conf import settings
from django.urls import reverse
from prometheus_client.parser import text_string_to_metric_families

from chatapp.api.keys import api_key_create
from chatapp.models import Turn
from chatapp.turns import admission
from router.models import AssignmentMove, Node
from router.services import assignment_move
from tests.factories import ConversationFactory, NodeFactory
from tests.helpers import wait_for_turn, wait_until

pytestmark = pytest.mark.django_db(transaction=True)


def scrape(client) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics by name and labels (it must parse as Prometheus' text format)."""
    response = client.get("/metrics")
    assert response.status_code == 200 and response["Content-Type"].startswith("text/plain; version=")
    samples = {}
    for family in text_string_to_metric_families(response.content.decode()):
        for sample in family.samples:
            samples[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def test_a_turn_moves_the_counters_by_what_it_cost(client, node):
    def of_node(samples: dict, name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted({"node": node, **labels}.items()))), 0)

    def served() -> int:
        return Node.objects.get(name=node).stats.get("totals", {}).get("requests", 0)

    requests_before = served()
    before = scrape(client)
    turn = wait_for_turn(admission.turn_start(conversation=ConversationFactory.create(), text="Count to three."))
    assert turn.status == Turn.Status.DONE
    wait_until(lambda: served() == requests_before + 1, 10, "the node's next heartbeat")
    after = scrape(client)

    def moved(name: str, **labels: str) -> float:
        return of_node(after, name, **labels) - of_node(before, name, **labels)

    done = ("chat_turns_total", (("status", "done"),))
    assert after[done] == before.get(done, 0) + 1
    assert moved("chat_node_generated_tokens_total") == turn.completion_tokens
    assert moved("chat_node_prompt_tokens_total", kind="computed") == turn.computed_tokens
    assert moved("chat_node_prompt_tokens_total", kind="cached") == turn.cached_tokens
    assert moved("chat_node_first_token_seconds_count") == 1
    assert moved("chat_node_first_token_seconds_bucket", le="+Inf") == 1
    assert moved("chat_node_requests_total") == 1
    # The prompt's computed tokens went through prefill steps; the reply through decode steps of one token
    # each (the turn ran alone), every step timed inside llama_decode.
    assert moved("chat_node_step_tokens_total", kind="prefill") == turn.computed_tokens
    assert 1 <= moved("chat_node_steps_total", kind="prefill") <= turn.computed_tokens
    assert moved("chat_node_step_tokens_total", kind="decode") == moved("chat_node_steps_total", kind="decode")
    assert moved("chat_node_steps_total", kind="decode") >= turn.completion_tokens - 1
    assert moved("chat_node_step_seconds_total", kind="prefill") > 0
    assert moved("chat_node_step_seconds_total", kind="decode") > 0
    assert after[("chat_node_up", (("model", turn.model), ("node", node)))] == 1
    assert of_node(after, "chat_node_kv_cells_total") > 0
    assert after[("chat_router_assignments", (("node", node),))] >= 1


def test_api_errors_and_router_moves_are_counted(client, node, user):
    before = scrape(client)
    response = client.post(reverse("api:chat_completions"), data="{nope", content_type="application/json")
    assert response.status_code in (400, 401)
    code = json.loads(response.content)["error"]["code"] or str(response.status_code)
    conversation = ConversationFactory.create()
    wait_for_turn(admission.turn_start(conversation=conversation, text="hi"))
    key = conversation.session_key
    held = lambda: Node.objects.get(name=node).stats.get("sessions", {}).get(key)  # noqa: E731
    wait_until(lambda: held() == "resident", 10, "the node to report the session")
    NodeFactory.create(name=f"spare-{time.monotonic_ns()}")
    spare = Node.objects.exclude(name=node).filter(status=Node.Status.UP).latest("id")
    assignment_move(session_key=conversation.session_key, node_name=spare.name, reason="moved by an operator")
    after = scrape(client)
    errors = ("chat_api_errors_total", (("code", code),))
    assert after[errors] == before.get(errors, 0) + 1
    moves = ("chat_router_moves_total", (("cold", "false"), ("held", "resident"), ("reason", "moved by an operator")))
    assert after[moves] == before.get(moves, 0) + 1  # the move cost the session its resident cache
    assert AssignmentMove.objects.get(session_key=key).warm


def test_readyz_needs_postgres_redis_and_a_node(client, node):
    assert client.get("/healthz").status_code == 200
    ready = client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"] is True and ready.json()["nodes"].endswith("up")
    Node.objects.update(status=Node.Status.DOWN)
    down = client.get("/readyz")
    assert down.status_code == 503 and down.json()["nodes"] == "failing: no inference node is up"
    assert down.json()["postgres"] == down.json()["redis"] == "ok"


def test_readyz_fails_without_redis(client, node, settings):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there: the probe's connection is refused
    down = client.get("/readyz")
    assert down.status_code == 503 and down.json()["redis"].startswith("failing") and down.json()["postgres"] == "ok"


def test_an_api_stream_is_counted_open_until_its_client_goes_away(client, node, user, asgi_server):
    _, key = api_key_create(owner=user, name="metrics")
    opened = ("chat_open_streams", (("kind", "api"),))
    before = scrape(client).get(opened, 0)
    body = {
        "model": settings.CHAT_DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": True,
        "max_tokens": 256,
        "ignore_eos": True,
    }
    server = urlsplit(asgi_server)
    connection = http.client.HTTPConnection(server.hostname, server.port, timeout=60)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # the stream is open
    assert scrape(client)[opened] == before + 1
    connection.close()  # the client goes away mid-reply
    wait_until(lambda: scrape(client)[opened] == before, 10, "the stream to be counted closed")
    turn = Turn.objects.latest("id")
    wait_until(lambda: Turn.objects.get(pk=turn.pk).status == Turn.Status.CANCELLED, 10, "the turn to be cancelled")
