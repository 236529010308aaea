"""`replay --dry-run`: assembly costs from a JSONL fixture, without a model or a node."""

import csv
import io
import itertools
import json
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from chatapp.experiments.models import Experiment, ReplayTurn

FIXTURE = Path(__file__).parent / "sessions.jsonl"
pytestmark = pytest.mark.django_db


def dry_run(tmp_path: Path, strategies: str, *extra: str) -> dict:
    out = tmp_path / "out"
    with (tmp_path / "stdout.json").open("w") as stdout:
        call_command(
            "replay", "--dry-run", "--source", "jsonl", "--file", str(FIXTURE), "--strategies", strategies,
            "--out", str(out), "--json", *extra, stdout=stdout,
        )  # fmt: skip
    return json.loads((tmp_path / "stdout.json").read_text())


def test_dry_run_measures_each_strategy_on_the_same_sessions(tmp_path):
    report = dry_run(tmp_path, "full,window:exchanges=2")
    experiment = Experiment.objects.get(pk=report["experiment"]["id"])
    assert experiment.dry_run and experiment.source == "jsonl"
    full, window = report["runs"]
    assert (full["label"], window["label"]) == ("full", "window:exchanges=2")
    assert full["turns"] == window["turns"] == 6 + 6 + 6  # every user message of the three sessions
    assert full["failed"] == window["failed"] == 0

    # Full resends everything: each prompt extends the previous prompt and reply, so nothing breaks.
    full_turns = ReplayTurn.objects.filter(run__label="full", run__experiment=experiment)
    for session in range(3):
        prompts = list(
            full_turns.filter(session=session).values_list("prompt_tokens", "reusable_tokens", "prefix_break")
        )
        assert all(later[0] > earlier[0] for earlier, later in itertools.pairwise(prompts))
        assert all(reusable > 0 and not broke for _, reusable, broke in prompts[1:])
    assert full["prefix_breaks"] == 0 and full["cache_hit_ratio"] > 0.5

    # A window of two exchanges starts dropping at the fourth turn and breaks the prefix from then on.
    assert window["prefix_breaks"] == 3 * 3
    assert window["prompt_tokens"] < full["prompt_tokens"]
    assert window["dropped_messages_per_turn"] > 0
    assert window["ttft_ms_p50"] is None and window["turns_per_s"] is None  # no model, no timings


def test_dry_run_writes_csv_json_and_charts(tmp_path):
    dry_run(tmp_path, "full,token_budget:history_tokens=64")
    out = tmp_path / "out"
    rows = list(csv.DictReader((out / "turns.csv").open()))
    assert len(rows) == 2 * 18 and {r["label"] for r in rows} == {"full", "token_budget:history_tokens=64"}
    assert json.loads((out / "report.json").read_text())["runs"][1]["budget"] == 64
    for chart in ("prompt_tokens", "computed_cached", "hit_ratio"):
        assert (out / f"{chart}.png").read_bytes().startswith(b"\x89PNG")
    assert not (out / "ttft.png").exists()  # a dry run has no timings to chart


def test_dry_run_of_a_probe_set_records_distances(tmp_path):
    probes = tmp_path / "probes.jsonl"
    call_command("make_probes", "--distances", "0,2", "--per-distance", "2", "--out", str(probes), stdout=io.StringIO())
    report = dry_run(tmp_path, "full", "--source", "probes", "--file", str(probes))
    assert report["runs"][0]["turns"] == 2 * (0 + 2) + 2 * (2 + 2)  # fact, fillers, question
    assert report["runs"][0]["recall"] is None  # recall needs the model's replies


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strategies", "nonsense"], "Unknown memory strategy 'nonsense'"),
        (["--strategies", "window:exchanges"], "key=value"),
        (["--strategies", "window:colour=blue"], "bad OPTIONS"),
        (["--source", "jsonl"], "needs --file"),
    ],
)
def test_bad_options_are_refused_before_anything_is_stored(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("replay", "--dry-run", *args)
    assert not Experiment.objects.exists()


def test_a_malformed_line_is_named(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(FIXTURE.read_text().splitlines()[0] + "\n{not json\n")
    with pytest.raises(CommandError, match=r"bad.jsonl, line 2"):
        call_command("replay", "--dry-run", "--source", "jsonl", "--file", str(bad))
    assert not Experiment.objects.exists()
