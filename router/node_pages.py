"""A node as its admin page shows it: its load over time (from the samples its heartbeats keep) and the
sessions it holds, each with where its cached state is."""

from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from matplotlib.figure import Figure

from router.charts import png_data_url
from router.models import Node, NodeSample, SessionAssignment

SESSIONS_SHOWN = 100
PLACES = {"resident": "resident in its context", "ram": "spilled to RAM", "disk": "in the disk tier"}


def load_chart(node: Node) -> str:
    """KV cells used (of the total) and sessions resident, spilled and on disk over the kept history, as
    a PNG data URL ("" before the first sample)."""
    samples = list(NodeSample.objects.filter(node=node).order_by("at"))
    if not samples:
        return ""
    at = [s.at for s in samples]
    figure = Figure(figsize=(7, 3.6), dpi=100)
    kv, sessions = figure.subplots(2, 1, sharex=True)
    kv.plot(at, [s.kv_cells_used for s in samples], label="KV cells used", color="#d9534f")
    kv.plot(at, [s.kv_cells_total for s in samples], label="total", color="#888888", linestyle="--")
    kv.set_ylabel("cells")
    kv.legend(loc="upper left", fontsize="small")
    for field, colour in (("resident_sessions", "#5b8fc7"), ("spilled_sessions", "#e0a030"), ("disk_sessions", "#6a6")):
        sessions.plot(at, [getattr(s, field) for s in samples], label=field.replace("_", " "), color=colour)
    sessions.set_ylabel("sessions")
    sessions.legend(loc="upper left", fontsize="small")
    figure.autofmt_xdate()
    return png_data_url(figure)


def render_load(node: Node) -> SafeString:
    chart = load_chart(node)
    if not chart:
        return format_html("<p>{}</p>", "No samples yet: a node keeps one every ROUTER_NODE_SAMPLE_SECONDS.")
    return format_html('<img src="{}" alt="KV use and sessions of {} over time">', chart, node.name)


def render_sessions(node: Node) -> SafeString:
    """The sessions assigned to the node (newest first) and those it holds for others, with where each
    one's cached state is, as its last heartbeat reported."""
    held: dict[str, str] = node.stats.get("sessions") or {}
    assigned = list(SessionAssignment.objects.filter(node=node).order_by("-assigned_at")[:SESSIONS_SHOWN])
    assigned_keys = {a.session_key for a in assigned}
    rows: list[tuple[str, str, str]] = [
        (
            format_html(
                '<a href="{}">{}</a>', reverse("admin:router_sessionassignment_change", args=[a.pk]), a.session_key
            ),
            "assigned here",
            PLACES.get(held.get(a.session_key, ""), "not cached"),
        )
        for a in assigned
    ]
    rows += [
        (key, "not assigned here", PLACES.get(place, place)) for key, place in held.items() if key not in assigned_keys
    ]
    if not rows:
        return format_html("<p>{}</p>", "No sessions.")
    return format_html(
        "<table><thead><tr><th>session</th><th>router</th><th>cached state</th></tr></thead><tbody>{}</tbody></table>",
        format_html_join("", "<tr><td>{}</td><td>{}</td><td>{}</td></tr>", rows),
    )
