"""An experiment's charts as PNG, drawn with matplotlib's object API (no pyplot state: safe in threads)."""

import io
from collections import defaultdict
from collections.abc import Callable

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from chatapp.experiments.models import Experiment, ReplayTurn
from chatapp.experiments.report import experiment_report


def _by_turn_index(experiment: Experiment, field: str) -> dict[str, dict[int, float]]:
    """Per run label: the mean of `field` over sessions at each turn index (finished turns only)."""
    sums: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    rows = ReplayTurn.objects.filter(run__experiment=experiment, status="done").values_list(
        "run__label", "run__policy", "index", field
    )
    for label, policy, index, value in rows:
        if value is not None:
            sums[_name(label, policy)][index].append(value)
    return {name: {i: sum(v) / len(v) for i, v in sorted(series.items())} for name, series in sums.items()}


def _name(label: str, policy: str) -> str:
    return f"{label} ({policy})" if policy else label


def _lines(ax: Axes, series: dict[str, dict[int, float]], ylabel: str) -> None:
    for name, points in series.items():
        ax.plot(list(points), list(points.values()), marker="o", markersize=3, label=name)
    ax.set_xlabel("turn index")
    ax.set_ylabel(ylabel)


def _prompt_tokens(experiment: Experiment, ax: Axes) -> None:
    _lines(ax, _by_turn_index(experiment, "prompt_tokens"), "prompt tokens (mean over sessions)")


def _ttft(experiment: Experiment, ax: Axes) -> None:
    _lines(ax, _by_turn_index(experiment, "ttft_ms"), "time to first token, ms (mean)")


def _computed_cached(experiment: Experiment, ax: Axes) -> None:
    runs = experiment_report(experiment)["runs"]
    names = [_name(r["label"], r["policy"]) for r in runs]
    cached = [r["cached_tokens"] for r in runs]
    computed = [r["computed_tokens"] for r in runs]
    ax.bar(names, cached, label="cached")
    ax.bar(names, computed, bottom=cached, label="computed")
    ax.set_ylabel("prompt tokens, all turns")
    ax.tick_params(axis="x", labelrotation=20)


def _hit_ratio(experiment: Experiment, ax: Axes) -> None:
    runs = experiment_report(experiment)["runs"]
    ax.bar([_name(r["label"], r["policy"]) for r in runs], [r["cache_hit_ratio"] or 0 for r in runs])
    ax.set_ylim(0, 1)
    ax.set_ylabel("cache hit ratio (cached / prompt tokens)")
    ax.tick_params(axis="x", labelrotation=20)


def _recall_budget(experiment: Experiment, ax: Axes) -> None:
    """One line per strategy alias over its runs' budgets; runs without a budget as horizontal lines."""
    report = experiment_report(experiment)
    aliases = dict(experiment.runs.values_list("pk", "strategy"))
    budgeted: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for r in report["runs"]:
        if r["recall"] is None:
            continue
        if r["budget"]:
            budgeted[aliases[r["run"]]].append((r["budget"], r["recall"]))
        else:
            ax.axhline(r["recall"], linestyle="--", color="grey", label=f"{r['label']} (no budget)")
    for alias, points in budgeted.items():
        points.sort()
        ax.plot([b for b, _ in points], [recall for _, recall in points], marker="o", label=alias)
    ax.set_xlabel("history budget, tokens")
    ax.set_ylabel("recall of planted facts")
    ax.set_ylim(0, 1.05)


def _recall_distance(experiment: Experiment, ax: Axes) -> None:
    for label, points in experiment_report(experiment)["recall_by_distance"].items():
        if points:
            ax.plot(list(points), list(points.values()), marker="o", label=label)
    ax.set_xlabel("exchanges between fact and question")
    ax.set_ylabel("recall of planted facts")
    ax.set_ylim(0, 1.05)


CHARTS: dict[str, tuple[str, Callable[[Experiment, Axes], None]]] = {
    "prompt_tokens": ("Prompt tokens per turn", _prompt_tokens),
    "computed_cached": ("Computed and cached prompt tokens", _computed_cached),
    "hit_ratio": ("Cache hit ratio", _hit_ratio),
    "ttft": ("Time to first token by turn", _ttft),
    "recall_budget": ("Recall against history budget", _recall_budget),
    "recall_distance": ("Recall against distance", _recall_distance),
}


def available(experiment: Experiment) -> list[str]:
    """The charts this experiment has data for: recall needs probes, TTFT a live run."""
    names = ["prompt_tokens", "computed_cached", "hit_ratio"]
    if not experiment.dry_run:
        names.append("ttft")
        if ReplayTurn.objects.filter(run__experiment=experiment, recalled__isnull=False).exists():
            names += ["recall_budget", "recall_distance"]
    return names


def render(experiment: Experiment, name: str) -> bytes:
    title, draw = CHARTS[name]
    figure = Figure(figsize=(7, 4), dpi=100, layout="constrained")
    ax = figure.subplots()
    draw(experiment, ax)
    ax.set_title(title)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()
