"""A turn as its admin page shows it to operators: the prompt segment by segment (template markers apart
from text), what the strategy dropped, where the turn ran and how often it was sent again."""

from datetime import datetime
from urllib.parse import urlencode

from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

from chatapp.models import Message, Turn
from router.models import Node, SessionAssignment

SEGMENT_LABELS = {
    "system": "system prompt",
    "pinned": "pinned messages and facts",
    "summary": "summaries",
    "retrieved": "retrieved",
    "recalled": "recalled",
    "verbatim": "verbatim",
}
EXCERPT = 80


def segment_label(turn: Turn, index: int) -> str:
    """What segment `index` of the turn's prompt holds; the last one is always the new message."""
    segments = turn.trace.get("segments", [])
    if index == len(segments) - 1 and segments[index]["ids"] == [turn.user_message_id]:
        return "new message"
    return SEGMENT_LABELS.get(segments[index]["kind"], segments[index]["kind"])


def trace_messages(turn: Turn) -> dict[int, Message]:
    """Every message the trace names (kept or dropped), in one query."""
    trace = turn.trace
    ids = {i for segment in trace.get("segments", []) for i in segment["ids"]} | set(trace.get("dropped", []))
    return Message.objects.only("id", "role", "content").in_bulk(ids)


def _message_links(ids: list[int], messages: dict[int, Message]) -> SafeString:
    return format_html_join(
        "",
        '<li><a href="{}">#{}</a> {}: {}</li>',
        (
            (reverse("admin:chatapp_message_change", args=[i]), i, m.role, _excerpt(m.content))
            for i in ids
            if (m := messages.get(i)) is not None
        ),
    )


def render_message(message: Message) -> SafeString:
    """A message in full, with a link to its own page."""
    url = reverse("admin:chatapp_message_change", args=[message.pk])
    return format_html('<a href="{}">#{}</a> <span class="message-text">{}</span>', url, message.pk, message.content)


def _excerpt(text: str) -> str:
    return text if len(text) <= EXCERPT else text[: EXCERPT - 1] + "…"


def render_segments(turn: Turn, messages: dict[int, Message]) -> SafeString:
    """A table of the prompt's segments in order: what each is, its tokens, and its messages."""
    segments = turn.trace.get("segments", [])
    if not segments:
        return format_html("<p>{}</p>", "No prompt recorded yet.")
    rows = format_html_join(
        "",
        '<tr class="segment-{}"><td>{}</td><td>{}</td><td>{}</td><td><ul class="messages">{}</ul></td></tr>',
        (
            (s["kind"], index, segment_label(turn, index), s["tokens"], _message_links(s["ids"], messages))
            for index, s in enumerate(segments)
        ),
    )
    template_tokens = (turn.prompt_tokens or 0) - sum(s["tokens"] for s in segments)
    return format_html(
        '<table class="prompt-segments"><thead><tr><th>#</th><th>segment</th><th>tokens</th><th>messages</th>'
        '</tr></thead><tbody>{}<tr class="segment-template"><td></td><td>the template\'s own markers</td>'
        "<td>{}</td><td></td></tr></tbody></table>",
        rows,
        template_tokens if turn.prompt_tokens is not None else "",
    )


def render_prompt(turn: Turn) -> SafeString:
    """The exact prompt, each part coloured by the segment it came from and template markers set apart
    (turns recorded before the prompt's parts were kept show it as plain text)."""
    text, parts = turn.prompt_text, turn.trace.get("parts")
    if not parts or sum(part[2] for part in parts) != len(text):
        return format_html('<pre class="prompt">{}</pre>', text)
    spans, at = [], 0
    for segment, marker, n, _ in parts:
        piece, at = text[at : at + n], at + n
        if marker or segment < 0:
            spans.append(("marker", "template marker", piece))
        else:
            kind, label = turn.trace["segments"][segment]["kind"], segment_label(turn, segment)
            css = f"segment-{kind} new-message" if label == "new message" else f"segment-{kind}"
            spans.append((css, f"segment {segment}: {label}", piece))
    return format_html(
        '<pre class="prompt">{}</pre>', format_html_join("", '<span class="{}" title="{}">{}</span>', spans)
    )


def render_dropped(turn: Turn, messages: dict[int, Message]) -> SafeString:
    dropped = turn.trace.get("dropped", [])
    if not dropped:
        return format_html("<p>{}</p>", "Nothing: the whole history was resent.")
    return format_html(
        '<p>{} messages</p><ul class="messages">{}</ul>', len(dropped), _message_links(dropped, messages)
    )


def render_links(turn: Turn) -> SafeString:
    """Links to the turn's conversation, node, session assignment and the router's moves of the session."""
    key = turn.conversation.session_key
    branch = f" (a branch of #{turn.conversation.branched_from_id})" if turn.conversation.branched_from_id else ""
    links = [(f"conversation{branch}", reverse("admin:chatapp_conversation_change", args=[turn.conversation_id]))]
    node = Node.objects.filter(name=turn.node).only("id").first() if turn.node else None
    if node is not None:
        links.append((f"node {turn.node}", reverse("admin:router_node_change", args=[node.pk])))
    assignment = SessionAssignment.objects.filter(session_key=key).only("id").first()
    if assignment is not None:
        links.append(("session assignment", reverse("admin:router_sessionassignment_change", args=[assignment.pk])))
    moves = reverse("admin:router_assignmentmove_changelist") + "?" + urlencode({"q": key})
    links.append(("the router's moves of this session", moves))
    links.append((f"attempt history ({turn.attempt + 1})", "#attempts"))
    items = format_html_join("", '<li><a href="{}">{}</a></li>', ((url, text) for text, url in links))
    return format_html('<ul class="links">{}</ul>', items)


def render_attempts(turn: Turn) -> SafeString:
    """Each attempt, oldest first: the node that ran it, when, and how it ended (the last is the turn now)."""
    rows = [
        (
            a["attempt"],
            a["node"],
            a["status"],
            *map(_when, (a["queued_at"], a["started_at"], a["ended_at"])),
            a["why"],
            a["error"],
        )
        for a in turn.earlier_attempts
    ]
    times = (turn.queued_at, turn.started_at, turn.finished_at)
    rows.append((turn.attempt, turn.node, turn.status, *map(_when, times), "(current)", turn.error))
    return format_html(
        '<table id="attempts"><thead><tr><th>attempt</th><th>node</th><th>status</th><th>queued</th>'
        "<th>started</th><th>ended</th><th>sent again because</th><th>error</th></tr></thead><tbody>{}</tbody></table>",
        format_html_join("", "<tr>" + "<td>{}</td>" * 8 + "</tr>", rows),
    )


def _when(value: str | datetime | None) -> str:
    """A time as the admin shows it, to the second (attempt histories keep ISO strings)."""
    if value is None:
        return ""
    when = datetime.fromisoformat(value) if isinstance(value, str) else value
    return timezone.localtime(when).strftime("%Y-%m-%d %H:%M:%S")
