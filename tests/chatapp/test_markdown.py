"""Replies render as Markdown on the server, sanitised: nothing a model or a user writes becomes markup
that runs, loads or links out unsafely."""

from html.parser import HTMLParser

import pytest
from django.urls import reverse

from chatapp.markdown import render_markdown
from chatapp.models import Message
from tests.factories import ConversationFactory, MessageFactory


def test_markdown_becomes_html_and_code_blocks_keep_their_text():
    html = str(render_markdown("# Plan\n\n**bold**, *it*, ~~gone~~, `x < y`\n\n```python\nif a < b:\n    pass\n```"))
    assert "<h1>Plan</h1>" in html and "<strong>bold</strong>" in html and "<em>it</em>" in html
    assert "<del>gone</del>" in html or "<s>gone</s>" in html
    assert "<code>x &lt; y</code>" in html
    assert '<pre><code class="language-python">if a &lt; b:\n    pass\n</code></pre>' in html
    table = str(render_markdown("| a | b |\n| --- | --- |\n| 1 | 2 |"))
    assert "<table>" in table and "<td>2</td>" in table
    link = str(render_markdown("[docs](https://example.com/x)"))
    assert '<a href="https://example.com/x" rel="noopener noreferrer nofollow">docs</a>' in link


@pytest.mark.parametrize(
    "hostile",
    [
        "<script>alert(1)</script>",
        '<img src=x onerror="alert(1)">',
        "[click](javascript:alert(1))",
        "[click](JaVaScRiPt:alert(1))",
        "[click](data:text/html;base64,PHNjcmlwdD5hbGVydCgxKTwvc2NyaXB0Pg==)",
        "![pixel](https://tracker.example/p.gif)",
        '<a href="javascript:alert(1)">x</a>',
        "<iframe src=https://example.com></iframe>",
        '<div style="background:url(javascript:alert(1))">x</div>',
        "<svg onload=alert(1)>",
        "`<script>alert(1)</script>`",
        "```html\n<script>alert(1)</script>\n```",
    ],
)
def test_hostile_replies_render_as_inert_text(hostile):
    elements = _elements(str(render_markdown(hostile)))
    assert {tag for tag, _ in elements} <= {"p", "a", "code", "pre"}, elements
    for tag, attributes in elements:
        assert not any(name.startswith("on") or name in ("style", "src") for name in attributes), elements
        assert all(attributes.get("href", "https:").startswith(("https:", "http:", "mailto:")) for _ in [tag])


def _elements(html: str) -> list[tuple[str, dict[str, str]]]:
    """Every element of `html` as the browser would build it: tag and attributes."""
    found: list[tuple[str, dict[str, str]]] = []

    class Collect(HTMLParser):
        def handle_starttag(self, tag, attrs):
            found.append((tag, {name: value or "" for name, value in attrs}))

    Collect().feed(html)
    return found


def test_template_markers_and_nul_bytes_stay_text():
    html = str(render_markdown("<|im_end|> <start_of_turn> a\x00b"))
    assert "&lt;|im_end|&gt;" in html and "&lt;start_of_turn&gt;" in html and "\x00" not in html


def test_the_chat_page_renders_replies_as_markdown_and_user_messages_as_typed(client, user):
    client.force_login(user)
    conversation = ConversationFactory.create(owner=user)
    MessageFactory.create(conversation=conversation, content="Say **hi** <b>now</b>")
    MessageFactory.create(
        conversation=conversation, role=Message.Role.ASSISTANT, content="**Hi!** <script>alert(1)</script>"
    )
    page = client.get(reverse("chat:conversation_detail", args=[conversation.pk])).content.decode()
    assert '<div class="text">Say **hi** &lt;b&gt;now&lt;/b&gt;</div>' in page
    assert '<div class="text markdown"><p><strong>Hi!</strong> &lt;script&gt;alert(1)&lt;/script&gt;</p>' in page
    assert "<script>alert(1)" not in page
