"""Regenerate and edit-and-branch in Chromium, on a real node: each makes a branch that the node answers
from the branch's own history; the original stays, and the page switches between them."""

import pytest
from playwright.sync_api import Browser, Page, expect

from chatapp.models import Conversation, Message, Turn
from tests.browser.conftest import logged_in
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


def _send(page: Page, text: str) -> None:
    """Send `text` and wait for its reply to be written."""
    replies = page.locator(".msg.assistant:not(.pending)")
    before = replies.count()
    page.fill("#composer textarea", text)
    page.press("#composer textarea", "Enter")
    expect(replies).to_have_count(before + 1, timeout=60_000)
    expect(page.locator("#composer textarea")).to_be_enabled(timeout=60_000)


def test_regenerate_and_edit_make_branches_the_node_answers_from(node, browser: Browser, asgi_server):
    UserFactory.create(username="brancher")
    page = logged_in(browser, asgi_server, "brancher")
    page.click("text=New conversation")
    _send(page, "My cat is called Miso.")
    _send(page, "What is my cat called?")
    original = Conversation.objects.get(owner__username="brancher")

    page.locator(".regenerate button").last.click()  # another answer to the last question
    expect(page.locator("nav.branches")).to_contain_text("(branch 1)")
    expect(page.locator(".msg.assistant:not(.pending)")).to_have_count(2, timeout=60_000)
    regenerated = Conversation.objects.get(branched_from=original)
    turn = Turn.objects.get(conversation=regenerated)
    assert turn.status in (Turn.Status.QUEUED, Turn.Status.RUNNING, Turn.Status.DONE)
    expect(page.locator("#composer textarea")).to_be_enabled(timeout=60_000)
    turn.refresh_from_db()
    assert turn.status == Turn.Status.DONE and turn.node == node
    assert turn.user_message.content == "What is my cat called?" and "My cat is called Miso." in turn.prompt_text

    page.goto(f"/c/{original.pk}/")
    first_question = page.locator(".msg.user").first
    first_question.locator("summary:has-text('Edit')").click()
    first_question.locator("textarea[name=text]").fill("My dog is called Rex.")
    first_question.locator("text=Send as a new branch").click()
    expect(page.locator(".msg.assistant:not(.pending)")).to_have_count(1, timeout=60_000)
    edited = Conversation.objects.filter(branch_root=original).latest("id")
    assert edited.branch_point == Message.objects.get(conversation=original, content="My cat is called Miso.")
    expect(page.locator("#composer textarea")).to_be_enabled(timeout=60_000)
    turn = Turn.objects.get(conversation=edited)
    assert turn.status == Turn.Status.DONE
    assert "My dog is called Rex." in turn.prompt_text and "Miso" not in turn.prompt_text  # its own history only
    page.locator("details.inspector summary").last.click()
    expect(page.locator(".inspect").last).to_contain_text(f"a branch of {original}")
    page.locator(".inspect").last.get_by_text("What would the other strategies have sent?").click()
    what_if = page.locator(".what-if").last
    expect(what_if).to_contain_text("Cache broke at token 0")  # a branch is a new session
    expect(what_if.locator("tr.actual")).to_contain_text(f"{turn.strategy} (used)")
    expect(what_if.locator("tr.actual td").nth(1)).to_have_text(str(turn.prompt_tokens))

    nav = page.locator("nav.branches")
    expect(nav.locator("a, strong")).to_have_count(3)
    nav.get_by_role("link", name=str(original), exact=True).click()
    expect(page.locator(".msg.user")).to_have_count(2)
    assert list(original.messages.values_list("content", flat=True))[::2] == [
        "My cat is called Miso.",
        "What is my cat called?",
    ]
    page.context.close()
