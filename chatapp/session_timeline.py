"""A conversation's session, as the admin shows it: its turns in order with the router's moves between
them, and a chart of the prompt and computed tokens of each turn."""

from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from matplotlib.figure import Figure

from chatapp.models import Conversation, Turn
from router.charts import png_data_url
from router.models import AssignmentMove


def milliseconds(value: float | None) -> str:
    """A time as operators read it: "1,234 ms" (the fields hold raw floats)."""
    return "" if value is None else f"{value:,.0f} ms"


def session_timeline(conversation: Conversation) -> list[Turn | AssignmentMove]:
    """Turns and moves of the conversation's session, oldest first (two queries)."""
    turns = list(conversation.turns.order_by("created_at"))
    moves = list(AssignmentMove.objects.filter(session_key=conversation.session_key))
    return sorted([*turns, *moves], key=lambda entry: entry.created_at)


def tokens_chart(turns: list[Turn]) -> str:
    """Prompt and computed tokens per turn, as a PNG data URL ("" without a finished turn)."""
    measured = [t for t in turns if t.prompt_tokens is not None]
    if not measured:
        return ""
    figure = Figure(figsize=(6, 2.2), dpi=100)
    ax = figure.add_subplot()
    x = range(1, len(measured) + 1)
    ax.bar(x, [t.prompt_tokens or 0 for t in measured], label="prompt", color="#9bb7d4")
    ax.bar(x, [t.computed_tokens or 0 for t in measured], label="computed", color="#d9534f")
    ax.set_xticks(list(x))
    ax.set_xlabel("turn")
    ax.set_ylabel("tokens")
    ax.legend(loc="upper left", fontsize="small")
    return png_data_url(figure)


def render_timeline(conversation: Conversation) -> SafeString:
    entries = session_timeline(conversation)
    chart = tokens_chart([e for e in entries if isinstance(e, Turn)])
    image = format_html('<p><img src="{}" alt="prompt and computed tokens per turn"></p>', chart) if chart else ""
    return format_html("{}{}", image, _table(entries))


def render_recent_turns(node: str, limit: int = 20) -> SafeString:
    """The node's latest turns, newest first (one query)."""
    return _table(list(Turn.objects.filter(node=node).order_by("-created_at")[:limit]))


def _table(entries: list[Turn | AssignmentMove]) -> SafeString:
    return format_html(
        "<table><thead><tr><th>when</th><th>turn</th><th>status</th><th>node</th><th>strategy</th>"
        "<th>prompt / cached / computed</th><th>reused from</th><th>first token</th></tr></thead>"
        "<tbody>{}</tbody></table>",
        format_html_join("", "{}", ((_row(entry),) for entry in entries)),
    )


def _row(entry: Turn | AssignmentMove) -> SafeString:
    when = entry.created_at.strftime("%Y-%m-%d %H:%M:%S")
    if isinstance(entry, AssignmentMove):
        return format_html(
            '<tr class="move"><td>{}</td><td colspan="7">router moved the session from {} to {}: {} '
            "(it held: {})</td></tr>",
            when,
            entry.from_node,
            entry.to_node,
            entry.reason,
            entry.get_held_display(),
        )
    tokens = f"{entry.prompt_tokens} / {entry.cached_tokens} / {entry.computed_tokens}" if entry.prompt_tokens else ""
    return format_html(
        '<tr><td>{}</td><td><a href="{}">{}</a></td>' + "<td>{}</td>" * 6 + "</tr>",
        when,
        reverse("admin:chatapp_turn_change", args=[entry.pk]),
        entry.pk,
        entry.get_status_display(),
        entry.node,
        entry.strategy,
        tokens,
        entry.get_cache_source_display() if entry.cached_tokens else "",
        milliseconds(entry.ttft_ms),
    )
