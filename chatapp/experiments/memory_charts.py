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


def recall_by_budget(report: dict) -> bytes:
    """Evidence recall against the prompt budget, a line per strategy, with DRAGON's top-50 for reference."""
    figure, ax = _figure("LoCoMo evidence recall against prompt budget")
    lines: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for run in report["runs"]:
        lines[run["strategy"]].append((run["budget"], run["recall"] or 0.0))
    for name, points in lines.items():
        points.sort()
        ax.plot([b for b, _ in points], [r for _, r in points], marker="o", label=name)
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
    """Evidence recall against the median tokens each question had to compute: what quality costs."""
    figure, ax = _figure("LoCoMo evidence recall against computed tokens per question")
    for run in report["runs"]:
        if run["computed_tokens_median"] is None:
            continue
        ax.scatter(run["computed_tokens_median"], run["recall"] or 0.0, s=30)
        ax.annotate(
            f"{run['strategy']} @{run['budget']}",
            (run["computed_tokens_median"], run["recall"] or 0.0),
            xytext=(4, 3),
            textcoords="offset points",
            fontsize="x-small",
        )
    ax.set_xlabel("computed tokens per question (median; a warm cache reuses the rest)")
    ax.set_ylabel("share of evidence turns in the prompt")
    ax.set_ylim(0, 1.02)
    return _png(figure)


CHARTS = {"recall_by_budget.png": recall_by_budget, "recall_by_computed.png": recall_by_computed}
