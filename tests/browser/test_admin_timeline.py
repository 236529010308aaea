"""An operator in Chromium follows one session across two real nodes: the first node is drained from the
admin mid-conversation, and the conversation's page shows the turns on each node with the router's move
between them; the turn's page shows its prompt segment by segment."""

import uuid

import pytest
from playwright.sync_api import Browser, expect

from chatapp.models import Turn
from chatapp.turns import admission
from router.models import Node
from router.services import assignment_move
from tests.conftest import start_node, stop_node
from tests.factories import ConversationFactory, UserFactory
from tests.helpers import only_these_nodes, wait_for_turn

pytestmark = pytest.mark.django_db(transaction=True)
SHORT = {"max_tokens": 8, "temperature": 0}


def test_a_conversations_timeline_follows_its_session_to_another_node(test_database, browser: Browser, asgi_server):
    first, second = (f"{role}-{uuid.uuid4().hex[:6]}" for role in ("first", "second"))
    processes = [start_node(name, test_database, N_THREADS="1") for name in (first, second)]
    try:
        only_these_nodes(first, second)
        staff = UserFactory.create(username=f"operator-{uuid.uuid4().hex[:6]}", is_staff=True, is_superuser=True)
        conversation = ConversationFactory.create()
        assignment_move(session_key=conversation.session_key, node_name=first)
        before = wait_for_turn(admission.turn_start(conversation=conversation, text="Hi, I am Ana.", sampling=SHORT))
        assert (before.status, before.node) == (Turn.Status.DONE, first)

        page = browser.new_context(base_url=asgi_server).new_page()
        page.goto("/admin/login/")
        page.fill("input[name=username]", staff.username)
        page.fill("input[name=password]", "correct horse battery staple")
        page.click("input[type=submit]")
        page.goto("/admin/router/node/")
        page.locator("tr", has_text=first).locator("input.action-select").check()
        page.select_option("select[name=action]", "drain")
        page.click("button[name=index]")
        expect(page.locator(".messagelist")).to_contain_text("1 node(s) draining")
        assert Node.objects.get(name=first).status == Node.Status.DRAINING

        after = wait_for_turn(admission.turn_start(conversation=conversation, text="Where do I live?", sampling=SHORT))
        assert (after.status, after.node) == (Turn.Status.DONE, second)

        page.goto(f"/admin/chatapp/conversation/{conversation.pk}/change/")
        rows = page.locator(".field-session_timeline tbody tr")
        expect(rows).to_have_count(3)
        expect(rows.nth(0)).to_contain_text(first)
        expect(rows.nth(1)).to_contain_text(f"router moved the session from {first} to {second}: node down or draining")
        expect(rows.nth(2)).to_contain_text(second)
        chart = page.locator(".field-session_timeline img")
        expect(chart).to_be_visible()
        assert chart.evaluate("image => image.naturalWidth") > 0

        rows.nth(2).get_by_role("link", name=str(after.pk)).click()
        expect(page.locator("table.prompt-segments")).to_contain_text("new message")
        expect(page.locator("pre.prompt .marker").first).to_be_visible()
        expect(page.locator("pre.prompt")).to_contain_text("Where do I live?")
        expect(page.locator("#attempts")).to_contain_text(second)
        page.context.close()
    finally:
        Node.objects.filter(name=first).update(status=Node.Status.UP)
        for process in processes:
            stop_node(process)
