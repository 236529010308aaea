"""An experiment's figures: per-run summaries, recall against `full`, and the table, CSV and JSON outputs."""

import csv
import io
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from chatapp.experiments.models import Experiment, ReplayTurn, Run
from chatapp.memory.registry import strategy_options

TURN_COLUMNS = [
    "session",
    "index",
    "status",
    "node",
    "prompt_tokens",
    "cached_tokens",
    "reusable_tokens",
    "completion_tokens",
    "dropped_messages",
    "prefix_break",
    "ttft_ms",
    "queue_ms",
    "latency_ms",
    "probe_distance",
    "recalled",
]


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def run_budget(run: Run) -> int | None:
    """The run's history budget in tokens, for strategies that have one (recall against budget)."""
    options = strategy_options(run.strategy, run.strategy_options)
    return options.get("history_tokens", options.get("high"))


def run_summary(run: Run) -> dict:
    turns = list(run.turns.all())
    done = [t for t in turns if t.status == "done"]
    prompt = sum(t.prompt_tokens for t in done)
    cached = sum(t.cached_tokens for t in done)
    ttfts = [t.ttft_ms for t in done if t.ttft_ms is not None]
    latencies = [t.latency_ms for t in done if t.latency_ms is not None]
    probes = [t for t in turns if t.recalled is not None]
    seconds = None  # a dry run's speed is not the model's
    if run.finished_at and run.started_at and not run.experiment.dry_run:
        seconds = (run.finished_at - run.started_at).total_seconds()
    return {
        "turns": len(turns),
        "failed": len(turns) - len(done),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "computed_tokens": prompt - cached,
        "reusable_tokens": sum(t.reusable_tokens for t in done),
        "completion_tokens": sum(t.completion_tokens for t in done),
        # Replies that ended their turn before the reply cap (a chat model answers and stops).
        "ended_turn_share": _ratio(sum(t.completion_tokens < _cap(run) for t in done), len(done)),
        "prompt_tokens_per_turn": _ratio(prompt, len(done)),
        "computed_tokens_per_turn": _ratio(prompt - cached, len(done)),
        "cache_hit_ratio": _ratio(cached, prompt),
        "prefix_breaks": sum(t.prefix_break for t in done),
        "dropped_messages_per_turn": _ratio(sum(t.dropped_messages for t in done), len(done)),
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "latency_ms_p50": percentile(latencies, 50),
        "seconds": seconds,
        "turns_per_s": _ratio(len(done), seconds or 0),
        "recall": _ratio(sum(bool(t.recalled) for t in probes), len(probes)),
        "probes": len(probes),
    }


def _cap(run: Run) -> int:
    return run.experiment.params.get("max_tokens", 0)


def recall_by_distance(run: Run) -> dict[int, float]:
    hits: dict[int, list[bool]] = defaultdict(list)
    for turn in run.turns.filter(recalled__isnull=False, probe_distance__isnull=False):
        hits[turn.probe_distance].append(bool(turn.recalled))  # type: ignore[index]
    return {d: sum(v) / len(v) for d, v in sorted(hits.items())}


def experiment_report(experiment: Experiment) -> dict:
    """Everything the table, the JSON and the charts show; recall is also given relative to the `full` run
    under the same policy (same model, same sessions)."""
    runs = list(experiment.runs.all())
    rows = []
    for run in runs:
        summary = run.summary or run_summary(run)
        rows.append({"run": run.pk, "label": run.label, "policy": run.policy, "budget": run_budget(run)} | summary)
    full = {row["policy"]: row for row in rows if row["label"] == "full"}
    for row in rows:
        reference = full.get(row["policy"])
        row["recall_vs_full"] = (
            _ratio(row["recall"], reference["recall"]) if reference and row["recall"] is not None else None
        )
    return {
        "experiment": {
            "id": experiment.pk,
            "name": experiment.name,
            "source": experiment.source,
            "dry_run": experiment.dry_run,
            "params": experiment.params,
        },
        "runs": rows,
        "recall_by_distance": {run.label: recall_by_distance(run) for run in runs},
    }


TABLE_COLUMNS = [
    ("label", "run", "{}"),
    ("policy", "policy", "{}"),
    ("turns", "turns", "{}"),
    ("failed", "failed", "{}"),
    ("prompt_tokens_per_turn", "prompt/turn", "{:.0f}"),
    ("computed_tokens_per_turn", "computed/turn", "{:.0f}"),
    ("cache_hit_ratio", "hit ratio", "{:.2f}"),
    ("ended_turn_share", "ended", "{:.2f}"),
    ("prefix_breaks", "breaks", "{}"),
    ("ttft_ms_p50", "TTFT p50 ms", "{:.0f}"),
    ("ttft_ms_p99", "TTFT p99 ms", "{:.0f}"),
    ("turns_per_s", "turns/s", "{:.2f}"),
    ("recall", "recall", "{:.2f}"),
    ("recall_vs_full", "recall/full", "{:.2f}"),
]


def table(report: dict) -> str:
    header = [title for _, title, _ in TABLE_COLUMNS]
    return text_table(header, [[cell(row.get(key), fmt) for key, _, fmt in TABLE_COLUMNS] for row in report["runs"]])


def text_table(header: list[str], rows: list[list[str]], *, left: int = 2) -> str:
    """Fixed-width columns under a ruled header; the first `left` columns flush left, the rest right."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]

    def join(cells: list[str]) -> str:
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    return "\n".join([join(header), join(["-" * w for w in widths]), *(join(row) for row in rows)])


def cell(value, fmt: str) -> str:
    return "-" if value is None or value == "" else fmt.format(value)


def turns_csv(experiment: Experiment) -> str:
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(["run", "label", "policy", *TURN_COLUMNS])
    turns = (
        ReplayTurn.objects.filter(run__experiment=experiment).select_related("run").order_by("run", "session", "index")
    )
    for t in turns:
        writer.writerow([t.run_id, t.run.label, t.run.policy, *(getattr(t, c) for c in TURN_COLUMNS)])
    return out.getvalue()


def write_outputs(experiment: Experiment, out_dir: Path) -> list[Path]:
    """turns.csv, report.json and the charts (PNG) in `out_dir`; the paths written."""
    from chatapp.experiments import charts

    out_dir.mkdir(parents=True, exist_ok=True)
    report = experiment_report(experiment)
    written = [out_dir / "turns.csv", out_dir / "report.json"]
    written[0].write_text(turns_csv(experiment), encoding="utf-8")
    written[1].write_text(json.dumps(report, indent=2, default=str), encoding="utf-8")
    for name in charts.available(experiment):
        path = out_dir / f"{name}.png"
        path.write_bytes(charts.render(experiment, name))
        written.append(path)
    return written
