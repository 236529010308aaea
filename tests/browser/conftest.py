"""The browser the UI tests drive: Debian's Chromium, headless, through Playwright."""

import os
import re
import shutil
from collections.abc import Iterator
from html import unescape

import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright

from chatapp.markdown import render_markdown

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # Playwright's sync API keeps an event loop running on this thread; the test's own ORM calls are
    # plain sync calls between browser steps (the remedy Playwright and pytest-django document).
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            headless=True,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update"],
        )
        yield browser
        browser.close()
    del os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"]


def logged_in(browser: Browser, base_url: str, username: str) -> Page:
    """A new browser context's page, logged in as `username` (made by UserFactory, with its password)."""
    page = browser.new_context(base_url=base_url).new_page()
    page.goto("/login/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", "correct horse battery staple")
    page.click("button[type=submit]")
    expect(page.get_by_role("button", name="New conversation")).to_be_visible()
    return page


def shown_reply(content: str) -> str:
    """The text a finished reply shows (its DOM's text content), rendered from `content` as Markdown."""
    return unescape(re.sub(r"<[^>]+>", "", str(render_markdown(content))))
