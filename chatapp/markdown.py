"""Replies as Markdown, rendered on the server: CommonMark with tables and strikethrough, raw HTML off
(it stays text), and the result sanitised with nh3 (Ammonia) to the tags Markdown makes, so neither the
model nor a user quoting it can inject script, handlers or `javascript:` links."""

from functools import lru_cache

import nh3
from django.utils.safestring import SafeString, mark_safe
from markdown_it import MarkdownIt

_PARSER = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable(["table", "strikethrough"])
# What CommonMark, tables and strikethrough produce, less images (a remote image in a reply would tell its
# server who read it); anything else is dropped with its attributes.
TAGS = {
    "p", "br", "hr", "em", "strong", "s", "del", "code", "pre", "blockquote", "ul", "ol", "li", "a",
    "h1", "h2", "h3", "h4", "h5", "h6", "table", "thead", "tbody", "tr", "th", "td",
}  # fmt: skip
ATTRIBUTES = {"a": {"href", "title"}, "code": {"class"}, "ol": {"start"}}


@lru_cache(maxsize=2048)
def render_markdown(text: str) -> SafeString:
    """`text` as sanitised HTML (cached: a page renders the same replies again on every load)."""
    html = _PARSER.render(text)
    clean = nh3.clean(
        html,
        tags=TAGS,
        attributes=ATTRIBUTES,
        url_schemes={"http", "https", "mailto"},
        link_rel="noopener noreferrer nofollow",
    )
    return mark_safe(clean)  # noqa: S308 -- sanitised by nh3 just above
