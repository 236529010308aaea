"""The chat page in a real browser (Debian's Chromium, headless, driven by Playwright) against the live
ASGI server and a real node: log in, stream a reply, inspect it, stop one, reload mid-stream."""

import re
import uuid
from collections.abc import Iterator

import pytest
from playwright.sync_api import Browser, Page, expect

from chatapp.models import Message, Turn
from router.models import Node
from tests.browser.conftest import logged_in, shown_reply
from tests.conftest import OUTPUT_DIR, start_node, stop_node
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)
SHOTS = OUTPUT_DIR / "screenshots"
# Long, sampled replies so that there is time to press Stop and to reload mid-reply.
LONG_REPLIES = {"MAX_REPLY_TOKENS": "200", "TEMPERATURE": "0.9", "REPEAT_PENALTY": "1.3", "IGNORE_EOS": "on"}


@pytest.fixture
def long_node(test_database) -> Iterator[str]:
    name = f"browser-{uuid.uuid4().hex[:6]}"
    process = start_node(name, test_database, **LONG_REPLIES)
    try:
        Node.objects.exclude(name=name).update(status=Node.Status.DOWN)
        yield name
    finally:
        stop_node(process)


@pytest.fixture
def page(browser: Browser, asgi_server: str, long_node: str) -> Iterator[Page]:
    SHOTS.mkdir(parents=True, exist_ok=True)
    UserFactory.create(username="browser")
    page = logged_in(browser, asgi_server, "browser")
    page.click("text=New conversation")
    yield page
    page.context.close()


def send(page: Page, text: str) -> None:
    page.fill("#composer textarea", text)
    page.press("#composer textarea", "Enter")


def test_a_reply_streams_in_and_the_inspector_shows_its_cost(page: Page):
    send(page, "Tell me about the sea.")
    expect(page.locator(".msg.user").last).to_contain_text("Tell me about the sea.")
    expect(page.locator("#composer textarea")).to_be_disabled()
    streaming = page.locator(".msg.pending .text")
    expect(streaming).not_to_be_empty(timeout=30_000)
    page.screenshot(path=str(SHOTS / "streaming.png"))
    first_seen = streaming.inner_text()

    reply = page.locator(".msg.assistant:not(.pending)").last
    expect(reply).to_be_visible(timeout=60_000)
    stored = Message.objects.get(role=Message.Role.ASSISTANT)
    assert reply.locator(".text").text_content() == shown_reply(stored.content)
    assert page.evaluate("document.body.dataset.lastStreamed").strip() == stored.content.strip()
    assert stored.content.strip().startswith(first_seen.strip())
    expect(page.locator("#composer textarea")).to_be_enabled()

    reply.locator("summary").click()
    inspector = reply.locator(".inspect")
    expect(inspector).to_contain_text(re.compile(r"\d+ reused(, [a-z' ]+)?; \d+ computed"))
    expect(inspector).to_contain_text("verbatim")
    page.screenshot(path=str(SHOTS / "inspector.png"), full_page=True)


def test_stop_ends_a_long_reply(page: Page):
    send(page, "Write a very long story about a lighthouse keeper.")
    expect(page.locator(".msg.pending .text")).not_to_be_empty(timeout=30_000)
    page.click(".msg.pending button.stop")
    expect(page.locator(".msg.pending")).to_have_count(0, timeout=30_000)
    turn = Turn.objects.get()
    assert turn.status == Turn.Status.CANCELLED
    assert turn.completion_tokens is not None and turn.completion_tokens < 200
    page.screenshot(path=str(SHOTS / "stopped.png"))


def test_a_reload_mid_stream_completes_the_text_once(page: Page):
    for attempt in range(3):  # a sampled reply can end early: reload only while one is still streaming
        send(page, f"Describe a busy market in a big city ({attempt}).")
        expect(page.locator(".msg.pending .text")).not_to_be_empty(timeout=30_000)
        turn = Turn.objects.latest("id")
        if not turn.is_finished:
            break
        expect(page.locator(".msg.pending")).to_have_count(0, timeout=30_000)
    page.reload()
    reply = page.locator(f"#message-{turn.user_message_id} ~ .msg.assistant:not(.pending)").first
    expect(reply).to_be_visible(timeout=60_000)
    turn.refresh_from_db()
    stored = turn.assistant_message
    assert stored is not None
    streamed = page.evaluate("document.body.dataset.lastStreamed")
    assert streamed.strip() == stored.content.strip()  # resumed after reload: nothing lost, nothing twice
    assert reply.locator(".text").text_content() == shown_reply(stored.content)
    assert page.locator(f"#message-{stored.pk}").count() == 1 and page.locator(".msg.pending").count() == 0
    page.screenshot(path=str(SHOTS / "after-reload.png"))
