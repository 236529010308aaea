"""The benchmark commands run end to end (tiny sizes) and print the figures the README reports."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from django.core.management import call_command

ROOT = Path(__file__).resolve().parent.parent


def run_command(*args: str) -> dict:
    result = subprocess.run(
        [sys.executable, "manage.py", *args, "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_bench_node_prints_its_figures():
    small = ["--repeats", "1", "--long-tokens", "300", "--batch", "2", "--decode-tokens", "8"]
    figures = run_command(
        "bench_node", *small, "--sessions", "2", "--turns", "2", "--reply-tokens", "8", "--no-baseline"
    )
    assert figures["warm_extra_prefill_tokens"] == 0
    assert figures["warm_cold_ttft_ratio"] > 1
    assert 0 < figures["restore_vs_recompute"] < 1
    assert figures["batch2_decode_speedup"] > 0
    assert figures["batch2_throughput_speedup"] > 0
    assert figures["replay_tokens"] > 0


def test_bench_router_prints_its_figures_per_policy():
    small = ["--nodes", "3", "--scale-nodes", "50", "--sessions", "200", "--decisions", "100"]
    figures = run_command("bench_router", *small, "--replay-sessions", "30", "--replay-turns", "200", "--repeats", "2")
    assert set(figures) == {
        "latency at 3 nodes",
        "latency at 50 nodes",
        *("sticky", "sticky_sessions", "round_robin", "least_loaded", "random"),
    }
    assert 0 < figures["latency at 50 nodes"]["p50_assign_ms"] <= figures["latency at 50 nodes"]["p99_placement_ms"]
    sticky = figures["sticky"]
    assert sticky["affinity"] > figures["round_robin"]["affinity"]
    assert sticky["affinity_range"][0] <= sticky["affinity"] <= sticky["affinity_range"][1]
    assert sticky["max_mean_load"] >= 1 and sticky["warm_moves_per_turn"] <= sticky["moves_per_turn"]


@pytest.mark.django_db(transaction=True)
def test_load_test_streams_sessions_through_the_web_and_two_nodes_and_audits_them():
    out = io.StringIO()
    call_command(
        "load_test", "--sessions", "4", "--duration", "8", "--max-tokens", "8", "--open-streams", "40", "--json",
        stdout=out,
    )  # fmt: skip
    figures = json.loads(out.getvalue())
    assert figures["streams_complete"] == 40 and figures["open_streams_peak"] > 0  # each read to its end
    assert figures["postgres_connections_peak"] < figures["postgres_max_connections"]
    assert figures["requests_accepted"] > 0 and figures["errors"] == 0
    assert figures["turns_stored"] == figures["turns_done"] == figures["requests_accepted"]
    assert figures["replies_differing_from_stream"] == 0 and figures["unfinished"] == 0
    assert figures["ttft_ms_p50"] > 0 and figures["turns_per_s"] > 0
    assert set(figures["memory_mib"]) == {"web", "node-0", "node-1"}


@pytest.mark.django_db
def test_simulate_sweeps_cluster_sizes_and_policies(tmp_path):
    calibration = tmp_path / "calibration.json"
    calibration.write_text(
        json.dumps(
            {"prefill_tokens_per_s": 300, "step_ms_one": 20, "step_ms_per_extra": 6, "slots": 8, "kv_tokens": 50000}
        )
    )
    out = io.StringIO()
    call_command(
        "simulate", "--calibration", str(calibration), "--nodes", "1,4", "--sessions-per-node", "30",
        "--pool", "10", "--turns", "3", "--json", stdout=out,
    )  # fmt: skip
    rows = json.loads(out.getvalue())
    assert {(r["policy"], r["nodes"]) for r in rows} == {
        (p, n) for p in ("sticky", "sticky_sessions", "round_robin", "least_loaded", "random") for n in (1, 4)
    }
    for row in rows:
        assert row["requests"] == row["completed"] > row["sessions"]
    sticky, spread = (next(r for r in rows if r["nodes"] == 4 and r["policy"] == p) for p in ("sticky", "round_robin"))
    assert sticky["cache_hit_ratio"] > spread["cache_hit_ratio"]
