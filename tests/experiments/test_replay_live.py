"""A live replay end to end: the replay command drives real turns through turn_start, the router, a real
node process and the model; then the experiment's page, charts and the simulator's check read it."""

import json
from pathlib import Path

import pytest
from django.core.management import call_command

from chatapp.experiments.models import Experiment, ReplayTurn
from chatapp.models import Message, Turn
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def replayed(node, tmp_path) -> tuple[Experiment, dict, Path]:
    out = tmp_path / "out"
    with (tmp_path / "report.json").open("w") as stdout:
        call_command(
            "replay", "--strategies", "full,window:exchanges=1", "--sessions", "3", "--turns", "4",
            "--max-tokens", "8", "--concurrency", "3", "--out", str(out), "--json", stdout=stdout,
        )  # fmt: skip
    report = json.loads((tmp_path / "report.json").read_text())
    return Experiment.objects.get(pk=report["experiment"]["id"]), report, out


def test_two_strategies_three_sessions_four_turns_through_a_real_node(replayed, node):
    experiment, report, out = replayed
    assert not experiment.dry_run
    rows = ReplayTurn.objects.filter(run__experiment=experiment).select_related("turn")
    assert rows.count() == 2 * 3 * 4
    assert {r.status for r in rows} == {Turn.Status.DONE}
    assert {r.node for r in rows} == {node}
    for row in rows:
        # Each replayed turn is a real stored turn, with its reply stored once.
        assert row.turn is not None and row.turn.assistant_message is not None
        assert row.reply == row.turn.assistant_message.content and 0 < row.completion_tokens <= 8
        assert row.ttft_ms and row.latency_ms and row.latency_ms >= row.ttft_ms
    conversations = {r.turn.conversation_id for r in rows if r.turn}
    assert len(conversations) == 2 * 3
    assert Message.objects.filter(conversation__in=conversations, role="assistant").count() == 2 * 3 * 4

    full, window = report["runs"]
    # Full keeps every prompt a prefix of the next, and the sticky node reuses it.
    assert full["prefix_breaks"] == 0
    full_later = rows.filter(run__label="full", index__gt=0)
    assert all(r.cached_tokens >= r.reusable_tokens > 0 for r in full_later)
    # A one-exchange window drops the oldest exchange every turn from the third on.
    assert window["prefix_breaks"] == 3 * 2
    assert window["prompt_tokens"] < full["prompt_tokens"]
    assert full["cache_hit_ratio"] > window["cache_hit_ratio"]
    assert full["turns_per_s"] > 0 and full["ttft_ms_p50"] > 0
    for chart in ("prompt_tokens", "computed_cached", "hit_ratio", "ttft"):
        assert (out / f"{chart}.png").read_bytes().startswith(b"\x89PNG")


def test_the_experiment_page_shows_the_table_and_charts_to_staff_only(replayed, client):
    experiment, _, _ = replayed
    client.force_login(UserFactory.create())
    assert client.get(f"/experiments/{experiment.pk}/").status_code == 302  # to the staff login
    client.force_login(UserFactory.create(is_staff=True))
    page = client.get(f"/experiments/{experiment.pk}/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "window:exchanges=1" in html and "TTFT p50 ms" in html
    assert f"/experiments/{experiment.pk}/charts/ttft.png" in html
    chart = client.get(f"/experiments/{experiment.pk}/charts/ttft.png")
    assert chart["Content-Type"] == "image/png" and chart.content.startswith(b"\x89PNG")
    assert client.get(f"/experiments/{experiment.pk}/charts/recall_budget.png").status_code == 404  # no probes
    assert client.get("/experiments/").status_code == 200


def test_the_simulator_is_checked_against_the_replay(replayed, tmp_path, capsys):
    experiment, _, _ = replayed
    calibration = tmp_path / "calibration.json"
    profile = {"prefill_tokens_per_s": 300.0, "step_ms_one": 20.0, "step_ms_per_extra": 6.0, "slots": 16}
    calibration.write_text(json.dumps(profile | {"kv_tokens": 100000.0, "dispatch_ms": 20.0}))
    call_command("simulate", "--validate", str(experiment.pk), "--calibration", str(calibration), "--json")
    rows = json.loads(capsys.readouterr().out)
    assert {r["metric"] for r in rows} >= {"cache_hit_ratio", "ttft_ms_p50", "turns_per_s"}
    hit = next(r for r in rows if r["run"] == "full" and r["metric"] == "cache_hit_ratio")
    # The same sessions, prompts and replies on one sticky node: the simulated hit ratio is the replay's.
    assert hit["simulated"] == pytest.approx(hit["replay"], abs=0.05)
