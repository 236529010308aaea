"""The benchmark commands run end to end (tiny sizes) and print the figures the README reports."""

import json
import subprocess
import sys
from pathlib import Path

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
    assert figures["replay_tokens"] > 0


def test_bench_router_prints_its_figures_per_policy():
    small = ["--nodes", "3", "--sessions", "200", "--decisions", "100", "--replay-sessions", "30"]
    figures = run_command("bench_router", *small, "--replay-turns", "200")
    assert set(figures) == {"sticky", "round_robin", "least_loaded", "random"}
    assert figures["sticky"]["p99_assign_ms"] > 0
    assert figures["sticky"]["affinity"] > figures["round_robin"]["affinity"]
    assert figures["sticky"]["max_mean_load"] >= 1
