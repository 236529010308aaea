"""Replies as Markdown in Chromium: formatting and code blocks show, hostile markup never runs, and the
page follows the user's colour scheme."""

import pytest
from playwright.sync_api import Browser, expect

from chatapp.models import Message
from tests.factories import ConversationFactory, MessageFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)
HOSTILE = (
    "**Bold** and a list:\n\n- one\n- two\n\n```python\nprint('<b>kept</b>')\n```\n\n"
    '<img src=x onerror="document.body.dataset.pwned=1"> <script>document.body.dataset.pwned=2</script> '
    "[link](javascript:document.body.dataset.pwned=3)"
)


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_a_reply_renders_as_markdown_and_its_markup_never_runs(browser: Browser, asgi_server, scheme):
    owner = UserFactory.create()
    conversation = ConversationFactory.create(owner=owner)
    MessageFactory.create(conversation=conversation, content="Show me **markdown**")
    MessageFactory.create(conversation=conversation, role=Message.Role.ASSISTANT, content=HOSTILE)
    context = browser.new_context(base_url=asgi_server, color_scheme=scheme)
    page = context.new_page()
    page.goto("/login/")
    page.fill("input[name=username]", owner.username)
    page.fill("input[name=password]", "correct horse battery staple")
    page.click("button[type=submit]")
    page.goto(f"/c/{conversation.pk}/")

    reply = page.locator(".msg.assistant .text.markdown")
    expect(reply.locator("strong")).to_have_text("Bold")
    expect(reply.locator("li")).to_have_count(2)
    expect(reply.locator("pre code")).to_have_text("print('<b>kept</b>')\n")
    expect(reply).to_contain_text("<script>document.body.dataset.pwned=2</script>")  # shown as text
    assert reply.locator("img, script, a[href^=javascript]").count() == 0
    assert page.evaluate("document.body.dataset.pwned") is None
    expect(page.locator(".msg.user .text")).to_have_text("Show me **markdown**")  # the user's words as typed
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert (background == "rgb(17, 19, 24)") == (scheme == "dark"), background
    context.close()
