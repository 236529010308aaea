"""A conversation's controls in Chromium, against the live server and a real node: a system prompt the
node then receives, rename, search, export and import (a real download and upload), and delete."""

import json

import pytest
from playwright.sync_api import Browser, expect

from chatapp.models import Conversation, Turn
from tests.browser.conftest import logged_in
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


def test_rename_system_prompt_search_export_import_and_delete(node, browser: Browser, asgi_server, tmp_path):
    UserFactory.create(username="controls")
    page = logged_in(browser, asgi_server, "controls")
    page.click("text=New conversation")
    page.click("summary:has-text('Conversation')")
    page.fill("textarea[name=system_prompt]", "You are a lighthouse keeper.")
    page.click("text=Save system prompt")
    expect(page.get_by_text("System prompt saved.")).to_be_visible()
    page.fill("#composer textarea", "What do you keep an eye on at night?")
    page.press("#composer textarea", "Enter")
    expect(page.locator(".msg.assistant:not(.pending)").last).to_be_visible(timeout=60_000)
    turn = Turn.objects.get(conversation__owner__username="controls")
    assert turn.trace["segments"][0]["kind"] == "system" and turn.trace["segments"][0]["tokens"] > 0
    assert "You are a lighthouse keeper." in turn.prompt_text  # what the node assembled and computed

    page.click("summary:has-text('Conversation')")
    page.fill("input[name=title]", "Night watch")
    page.click("text=Rename")
    expect(page.locator("h1")).to_have_text("Night watch")
    conversation = Conversation.objects.get(owner__username="controls")
    assert conversation.title == "Night watch"

    page.goto("/")
    page.fill("input[name=q]", "eye at night")
    page.click("button:has-text('Search')")
    expect(page.locator(".search-hits li")).to_have_count(1)
    expect(page.locator(".search-hits mark").first).to_be_visible()

    page.goto(f"/c/{conversation.pk}/")
    page.click("summary:has-text('Conversation')")
    with page.expect_download() as download:
        page.click("text=Export as JSON")
    exported = tmp_path / "night-watch.json"
    download.value.save_as(exported)
    data = json.loads(exported.read_text())
    assert [m["role"] for m in data["messages"]] == ["system", "user", "assistant"]

    page.goto("/")
    page.set_input_files("input[name=file]", str(exported))
    page.click("button:has-text('Import')")
    expect(page.get_by_text("Imported 2 messages.")).to_be_visible()
    copy = Conversation.objects.filter(owner__username="controls").exclude(pk=conversation.pk).get()
    assert (copy.title, copy.system_prompt) == ("Night watch", "You are a lighthouse keeper.")
    assert list(copy.messages.values_list("content", flat=True)) == [m["content"] for m in data["messages"][1:]]

    page.goto(f"/c/{conversation.pk}/")
    page.click("summary:has-text('Conversation')")
    page.click("text=Delete this conversation")
    expect(page.get_by_text("Deleted Night watch.")).to_be_visible()
    assert list(Conversation.objects.filter(owner__username="controls")) == [copy]
    page.context.close()
