"""bench_memory's charts as PNG, from its report (matplotlib's object API, as in `charts`)."""

import io
from collections import defaultdict

from matplotlib.figure import Figure

from chatapp.experiments.memory_bench import DRAGON, DRAGON_TOP50_TOKENS


def _figure(title: str):
    figure = Figure(figsize=(7, 4.2), dpi=100, layout="constrained")
    ax = figure.subplots()
    ax.set_title(title)
    return figure, ax


def _png(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def _colors(report: dict) -> dict[str, str]:
    """One colour a strategy, the same in every chart."""
    names = list(dict.fromkeys(run["strategy"] for run in report["runs"]))
    return {name: f"C{i % 10}" for i, name in enumerate(names)}


def recall_by_budget(report: dict) -> bytes:
    """Evidence recall against the prompt budget, a line per strategy, with DRAGON's top-50 for reference."""
    figure, ax = _figure("LoCoMo evidence recall against prompt budget")
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for run in report["runs"]:
        lines[run["strategy"]].append((run["budget"], run["recall"] or 0.0))
    colors = _colors(report)
    for name, points in lines.items():
        points.sort()
        ax.plot([b for b, _ in points], [r for _, r in points], marker="o", label=name, color=colors[name])
    ax.scatter([DRAGON_TOP50_TOKENS], [DRAGON["top-50 (~1,500 tokens)"]], marker="*", s=120, color="black")
    ax.annotate(
        "DRAGON top-50",
        (DRAGON_TOP50_TOKENS, DRAGON["top-50 (~1,500 tokens)"]),
        xytext=(6, -12),
        textcoords="offset points",
        fontsize="small",
    )
    ax.set_xlabel("prompt budget, tokens (reply excluded)")
    ax.set_ylabel("share of evidence turns in the prompt")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize="small")
    return _png(figure)


def recall_by_computed(report: dict) -> bytes:
    """Evidence recall against the median tokens each question had to compute, a line per strategy through
    its budgets: what quality costs with a warm cache."""
    figure, ax = _figure("LoCoMo evidence recall against computed tokens per question")
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for run in report["runs"]:
        if run["computed_tokens_median"] is not None:
            lines[run["strategy"]].append((run["computed_tokens_median"], run["recall"] or 0.0))
    colors = _colors(report)
    for name, points in lines.items():
        points.sort()
        ax.plot([c for c, _ in points], [r for _, r in points], marker="o", label=name, color=colors[name])
    ax.set_xlabel("computed tokens per question (median, over the budgets; a warm cache reuses the rest)")
    ax.set_ylabel("share of evidence turns in the prompt")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize="small")
    return _png(figure)


CHARTS = {"recall_by_budget.png": recall_by_budget, "recall_by_computed.png": recall_by_computed}
