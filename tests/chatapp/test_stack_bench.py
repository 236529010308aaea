"""bench_stack's parts: a replay through this stack's real API and node, the ratios' direction and spread,
a clear error without the comparison server, and a short A/B run against another checkout's stack. (The
side-by-side run with llama-server needs `make llama-server`, a ten-minute build, so the suite does not run
it; the README gives its figures and command.)"""

import json
import os
import shutil
import subprocess
import threading
import time
from itertools import islice
from pathlib import Path

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command
from django.db import connection

from chatapp import quotas
from chatapp.api.keys import api_key_create
from chatapp.datasets import chitchat_conversations
from chatapp.management.commands.bench_stack import LOG_DIR
from chatapp.models import Turn
from chatapp.stack_bench import (
    Server,
    check_same_prompts,
    process_cpu_s,
    replay,
    service_cpu_s,
    summarise,
    thread_cpu_s,
)
from tests.conftest import start_web, stop_node
from tests.factories import UserFactory

WHERE_OTHER_CPU_GOES = ("node", "web", "postgres", "redis-server")


@pytest.mark.django_db(transaction=True)
def test_a_replay_through_the_stack_resends_history_and_reads_its_cache_hits(node, test_database, model_file):
    user = UserFactory.create()
    quotas.grant_unlimited_use(user)
    _, key = api_key_create(owner=user, name="bench")
    # The CPU counted is a web process's of its own: its event loop's thread lives and works for the whole replay
    # (the client's threads, in this process, are gone when it is counted).
    web, url = start_web(test_database, log_name="bench-web")
    try:
        server = Server(
            "stack", url, model_file.name, (web.pid,), ("web",), key=key, compute_threads=1, services=("postgres",)
        )
        conversations = list(islice(chitchat_conversations(min_messages=6), 2))
        result = replay(server, conversations, turns=3, max_tokens=8, ignore_eos=True, tag="bench-test")
    finally:
        stop_node(web)

    assert result.errors == []
    assert len(result.ttft_ms) == 6 and result.completion_tokens == 6 * 8
    # Turns 2 and 3 of each session reuse the session's cache: everything but the new message.
    assert 0.3 < result.cached_tokens / result.prompt_tokens < 1
    figures = result.figures()
    assert figures["cpu_ms_per_token"] > 0 and figures["wall_s"] > 0
    # The busiest thread's share is never empty; the rest (other threads, Postgres) may round to no clock tick
    # in so short a replay.
    assert figures["compute_cpu_ms_per_token"] > 0 and figures["other_cpu_ms_per_token"] >= 0
    split = figures["compute_cpu_ms_per_token"] + figures["other_cpu_ms_per_token"]
    assert split == pytest.approx(figures["cpu_ms_per_token"])
    # The other CPU by where it went: the web process besides its busiest thread, and Postgres.
    parts = figures["other_cpu_of_web_ms_per_token"] + figures["other_cpu_of_postgres_ms_per_token"]
    assert parts == pytest.approx(figures["other_cpu_ms_per_token"])
    assert figures["ttft_p50_ms"] <= figures["ttft_p90_ms"]
    assert 0 <= figures["machine_idle_share"] < 1


def test_ratios_say_how_much_faster_this_stack_is_with_their_median_and_range():
    def run(wall: float, cache_hit: float) -> dict[str, float]:
        times = ("wall_s", "ttft_p50_ms", "ttft_p90_ms", "cpu_ms_per_token", "compute_cpu_ms_per_token")
        figures = dict.fromkeys(times, wall)
        return figures | {"cache_hit": cache_hit}

    results = {
        "8x12": {
            "stack": [run(10, 0.9), run(20, 0.9), run(30, 0.8)],
            "llama-server": [run(5, 0.9), run(30, 0.6), run(30, 0.8)],
        }
    }
    summary = summarise(results, "stack", "llama-server")
    assert summary["wall_ratio_8x12"] == 1.0  # llama-server / stack per pair: 0.5, 1.5, 1.0
    assert summary["wall_ratio_8x12_range"] == [0.5, 1.5]
    assert summary["cache_hit_ratio_8x12"] == 1.0  # stack / llama-server: 1.0, 1.5, 1.0
    assert summary["cache_hit_ratio_8x12_range"] == [1.0, 1.5]
    assert summary["stack_wall_s_8x12"] == 20 and summary["llama-server_wall_s_8x12"] == 30


def test_without_llama_server_the_command_says_how_to_build_it(tmp_path):
    with pytest.raises(CommandError, match="make llama-server"):
        call_command("bench_stack", "--llama-server", str(tmp_path / "missing"))
    with pytest.raises(CommandError, match="8x12,32x10"):
        call_command("bench_stack", "--scenarios", "8 by 12")


@pytest.mark.django_db(transaction=True)
def test_an_ab_run_replays_the_same_sessions_through_a_stack_from_another_checkout(tmp_path, capsys):
    baseline = tmp_path / "baseline"
    subprocess.run(["git", "clone", "--quiet", "--shared", settings.BASE_DIR, baseline], check=True, timeout=60)
    manage = baseline / "manage.py"  # a mark in the baseline's node log: its code, not this checkout's, ran
    manage.write_text(manage.read_text().replace("import sys\n", "import sys\nprint('from the baseline')\n", 1))

    call_command(
        "bench_stack", "--baseline", str(baseline), "--scenarios", "2x2", "--repeats", "1",
        "--max-tokens", "8", "--ignore-eos", "--json",
    )  # fmt: skip
    figures = json.loads(capsys.readouterr().out)

    assert figures["against"] == str(baseline)
    assert "from the baseline" in (LOG_DIR / "baseline" / "node.log").read_text()
    # Each side's stack answered a warm-up turn before its replay, and the replay's figures do not count it.
    warmed = Turn.objects.filter(conversation__api_session__endswith="-warm-up", status=Turn.Status.DONE)
    sessions = warmed.values_list("conversation__api_session", flat=True)  # session:bench-<run>-<side>-...
    assert sorted(session.split("-")[2] for session in sessions) == ["baseline", "stack"]
    for side in ("stack", "baseline"):
        assert figures[f"{side}_completion_tokens_2x2"] == 2 * 2 * 8
        assert figures[f"{side}_errors_2x2"] == 0
        assert figures[f"{side}_cache_hit_2x2"] > 0  # each session's second turn reuses its first
        # The other CPU, split by where it went: the node besides llama.cpp's threads, the web, the services.
        parts = [figures[f"{side}_other_cpu_of_{part}_ms_per_token_2x2"] for part in WHERE_OTHER_CPU_GOES]
        assert sum(parts) == pytest.approx(figures[f"{side}_other_cpu_ms_per_token_2x2"], rel=0.01, abs=0.01)
        # The node's own step counters: part of the replay inside llama_decode, some of it prefilling, and
        # one or both sessions in each decode step.
        assert 0 < figures[f"{side}_engine_prefill_share_2x2"] < figures[f"{side}_engine_busy_share_2x2"] <= 1
        assert 1 <= figures[f"{side}_decode_step_sequences_2x2"] <= 2
    # The same code on both sides writes the same greedy replies, so the second turns' prompts are the same.
    assert figures["stack_prompt_tokens_2x2"] == figures["baseline_prompt_tokens_2x2"]
    assert figures["wall_ratio_2x2"] > 0 and figures["wall_ratio_2x2_range"][0] == figures["wall_ratio_2x2"]


def test_a_baseline_is_another_checkout_with_the_same_migrations(tmp_path):
    with pytest.raises(CommandError, match=r"no manage\.py there"):
        call_command("bench_stack", "--baseline", str(tmp_path))
    with pytest.raises(CommandError, match="is this checkout"):
        call_command("bench_stack", "--baseline", str(settings.BASE_DIR))
    (tmp_path / "manage.py").touch()
    for app in ("chatapp", "router"):
        shutil.copytree(Path(settings.BASE_DIR) / app / "migrations", tmp_path / app / "migrations")
    (tmp_path / "router" / "migrations" / "0999_later.py").touch()
    with pytest.raises(CommandError, match=r"other migrations than this checkout: router/0999_later\.py\.$"):
        call_command("bench_stack", "--baseline", str(tmp_path))


def test_servers_that_saw_different_prompts_stop_the_comparison():
    """Each server's prompt tokens for the same conversations: replies differ a little, a chat rendered
    another way (llama-server sending a template's name instead of the chat, as it once did) a lot."""
    close = {"stack": [{"prompt_tokens": 35_345.0}], "llama-server": [{"prompt_tokens": 33_120.0}]}
    check_same_prompts(close, "stack", "llama-server")
    apart = {"stack": [{"prompt_tokens": 35_345.0}], "llama-server": [{"prompt_tokens": 288.0}]}
    with pytest.raises(RuntimeError, match="renders the chat differently"):
        check_same_prompts(apart, "stack", "llama-server")


def test_cpu_is_counted_per_thread_per_process_and_for_services_by_name(django_db_blocker):
    """The split of a server's CPU: a busy thread shows as one thread's time, a thread that ended still in
    its process's, and a query's work as Postgres's (its backends found by process name)."""
    hold = threading.Event()

    def burn_then_wait() -> None:  # a thread that ended would be gone from /proc: it waits to be read
        until = time.thread_time() + 0.3
        while time.thread_time() < until:
            pass
        hold.wait(10)

    before = thread_cpu_s([os.getpid()])
    busy = threading.Thread(target=burn_then_wait)
    busy.start()
    time.sleep(0.6)
    after = thread_cpu_s([os.getpid()])
    hold.set()
    busy.join()
    grew = sorted(after[t] - before.get(t, 0.0) for t in after)
    assert grew[-1] >= 0.25

    # A thread that has ended is gone from the threads, not from its process's time.
    process_before = process_cpu_s([os.getpid()])
    threads_before = sum(thread_cpu_s([os.getpid()]).values())
    ended = threading.Thread(target=burn_then_wait)
    ended.start()
    ended.join()
    # join() returns once Python is done with the thread, a moment before the kernel's thread is gone.
    deadline = time.monotonic() + 5
    while Path(f"/proc/self/task/{ended.native_id}").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert process_cpu_s([os.getpid()]) - process_before >= 0.25
    assert sum(thread_cpu_s([os.getpid()]).values()) - threads_before < 0.1

    postgres_before = service_cpu_s(("postgres",))
    with django_db_blocker.unblock(), connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM generate_series(1, 3000000)")
    assert service_cpu_s(("postgres",)) - postgres_before > 0.05
    assert service_cpu_s(()) == 0.0
