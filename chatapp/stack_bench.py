"""The same chat replay through two OpenAI-compatible servers, side by side (`bench_stack`): this stack and
llama.cpp's llama-server, or this stack and the same product from another checkout (an A/B of two commits).

A replay is N sessions x T turns of held-out chitchat conversations, all sessions at once: each turn
resends the session's whole history (streaming, greedy, a fixed `max_tokens`), and the reply the server
wrote goes into the history. Each server's figures come from its own answers (TTFT as the client saw it,
the cached prompt tokens it reports) and from /proc (the CPU time its processes used, split into
llama.cpp's compute threads and everything else the server needs: for this stack, the node's other
threads, the web process, Postgres and Redis). For this stack the node's own counters also say how much of
the replay its engine spent inside llama_decode, and how many sequences a decode step held.
"""

import http.client
import json
import math
import os
import re
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

from chatapp.chat_stream_client import read_chat_stream
from chatapp.experiments.report import percentile
from inference.benchmark import alternating, paired, run_parallel

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
Figures = list[dict[str, float]]  # one replay's figures per repeat
# ReplayResult.engine_figures' names, in the order the table shows them.
ENGINE_FIGURES = ("engine_busy_share", "engine_prefill_share", "decode_step_sequences")


def other_cpu_part(name: str) -> str:
    """The figure of a process's or service's share of the other CPU."""
    return f"other_cpu_of_{name}_ms_per_token"


def other_cpu_parts(summary: dict, server: str, label: str) -> dict[str, float]:
    """A server's other CPU by where it went, from `summarise`'s figures for one scenario."""
    figure = re.compile(re.escape(f"{server}_{other_cpu_part('@')}_{label}").replace("@", "(.+)"))
    return {match[1]: ms for key, ms in summary.items() if (match := figure.fullmatch(key))}


@dataclass(frozen=True)
class Server:
    name: str
    url: str
    model: str
    pids: tuple[int, ...]  # the processes whose CPU time is the server's
    names: tuple[str, ...]  # what each of `pids` is, naming its share of the other CPU
    key: str = ""  # bearer token
    body: dict = field(default_factory=dict)  # request fields only this server needs
    compute_threads: int = 2  # llama.cpp's threads: the busiest threads of `pids` in a replay
    services: tuple[str, ...] = ()  # programs, by process name, that work only for this server in its replay
    # The engine's decode-step totals by kind, exact when read between replays (this stack's node only).
    engine_steps: Callable[[], dict[str, dict[str, float]]] | None = None


@dataclass(frozen=True)
class Contender:
    """One side of the comparison: `serving()` gives its server, up, warmed up and idle, for one replay. A
    server that stays up for the whole run (`running`) or one started afresh for each replay (another
    checkout's stack, which must not share a database's nodes with this one's)."""

    name: str
    serving: Callable[[], AbstractContextManager[Server]]

    @classmethod
    def running(cls, server: Server) -> "Contender":
        return cls(server.name, lambda: nullcontext(server))


@dataclass(frozen=True)
class TurnResult:
    ttft_ms: float | None
    text: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


@dataclass
class ReplayResult:
    wall_s: float = 0.0
    compute_cpu_s: float = 0.0  # llama.cpp's threads
    other_cpu_s: float = 0.0  # every other thread of the server's processes, and its services
    other_cpu_parts: dict[str, float] = field(default_factory=dict)  # other_cpu_s by process and service
    machine_cpu_s: float = 0.0
    engine_steps: dict[str, dict[str, float]] = field(default_factory=dict)  # by kind: the replay's steps
    ttft_ms: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, turn: TurnResult) -> None:
        if turn.ttft_ms is not None:
            self.ttft_ms.append(turn.ttft_ms)
        self.prompt_tokens += turn.prompt_tokens
        self.cached_tokens += turn.cached_tokens
        self.completion_tokens += turn.completion_tokens

    def machine_idle_share(self) -> float:
        """The share of all cores' time that no process used during the replay: where a compute thread slept
        (at llama.cpp's barriers, waiting for its partner, or between steps) and nothing else ran.
        llama-server's threads spin through such waits for milliseconds (libgomp's default), so its share
        reads near zero with that spin counted as its CPU; the node's shorter spin (GOMP_SPINCOUNT) leaves the
        core free for the stack's other processes, and idle when they have nothing to do. /proc/stat counts
        in clock ticks: a fully busy machine can read a hair over its wall time."""
        capacity = self.wall_s * (os.cpu_count() or 1)
        return max(1 - self.machine_cpu_s / capacity, 0.0) if capacity else math.nan

    def engine_figures(self) -> dict[str, float]:
        """The share of the replay's wall time the engine spent in llama_decode (all steps, and prefill steps),
        and the sequences a decode step held on average; none for a server that does not count its steps."""
        if not self.engine_steps:
            return {}
        decode, prefill = self.engine_steps["decode"], self.engine_steps["prefill"]
        return {
            "engine_busy_share": (decode["seconds"] + prefill["seconds"]) / self.wall_s,
            "engine_prefill_share": prefill["seconds"] / self.wall_s,
            "decode_step_sequences": decode["tokens"] / max(decode["steps"], 1),
        }

    def figures(self) -> dict[str, float]:
        tokens = max(self.completion_tokens, 1)
        return {
            "wall_s": self.wall_s,
            "ttft_p50_ms": percentile(self.ttft_ms, 50) or math.nan,
            "ttft_p90_ms": percentile(self.ttft_ms, 90) or math.nan,
            "cache_hit": self.cached_tokens / max(self.prompt_tokens, 1),
            "cpu_ms_per_token": 1000 * (self.compute_cpu_s + self.other_cpu_s) / tokens,
            "compute_cpu_ms_per_token": 1000 * self.compute_cpu_s / tokens,
            "other_cpu_ms_per_token": 1000 * self.other_cpu_s / tokens,
            **{other_cpu_part(name): 1000 * cpu / tokens for name, cpu in self.other_cpu_parts.items()},
            "machine_cpu_ms_per_token": 1000 * self.machine_cpu_s / tokens,
            "machine_idle_share": self.machine_idle_share(),
            **self.engine_figures(),
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "errors": len(self.errors),
        }


def chat_turn(server: Server, session: str, messages: list[dict], max_tokens: int, ignore_eos: bool) -> TurnResult:
    """One streamed, greedy chat completion; raises RuntimeError on an HTTP or stream error."""
    parts = urlsplit(server.url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=600)
    body = {
        "model": server.model,
        "messages": messages,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        **server.body,
    }
    headers = {"Content-Type": "application/json", "X-Session-ID": session}
    if server.key:
        headers["Authorization"] = f"Bearer {server.key}"
    started = time.perf_counter()
    try:
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"{server.name}: HTTP {response.status}: {response.read()[:300]!r}")
        reply = read_chat_stream(response, started)
        if reply.error:
            raise RuntimeError(f"{server.name}: {reply.error}")
    finally:
        connection.close()
    return TurnResult(
        ttft_ms=reply.ttft_ms,
        text=reply.text,
        prompt_tokens=reply.usage.get("prompt_tokens", 0),
        cached_tokens=(reply.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        completion_tokens=reply.usage.get("completion_tokens", 0),
    )


def warm_up(server: Server, session: str) -> None:
    """One short turn before a server's first measured replay: a fresh server's one-off costs (a web process
    reading the model's vocabulary, a node's first decode, llama-server's first request) are not the
    replay's."""
    try:
        chat_turn(server, session, [{"role": "user", "content": "Hello!"}], max_tokens=8, ignore_eos=True)
    except OSError as exc:
        raise RuntimeError(f"{server.name}: the warm-up turn failed: {exc}") from exc


def replay(
    server: Server, conversations: Sequence[list[str]], *, turns: int, max_tokens: int, ignore_eos: bool, tag: str
) -> ReplayResult:
    """Every conversation as one session, all at once, `turns` user messages each."""
    result = ReplayResult()
    lock = threading.Lock()

    def one_session(k: int, texts: list[str]) -> None:
        history: list[dict] = []
        for turn in range(turns):
            history.append({"role": "user", "content": texts[2 * turn]})
            try:
                answer = chat_turn(server, f"{tag}-{k}", history, max_tokens, ignore_eos)
            except (OSError, RuntimeError) as exc:
                with lock:
                    result.errors.append(str(exc))
                return
            with lock:
                result.add(answer)
            history.append({"role": "assistant", "content": answer.text})

    steps_before = server.engine_steps() if server.engine_steps else {}
    threads_before = thread_cpu_s(server.pids)
    processes_before = {pid: process_cpu_s([pid]) for pid in server.pids}
    services_before = {name: service_cpu_s([name]) for name in server.services}
    machine_before = machine_cpu_s()
    result.wall_s = run_parallel([partial(one_session, k, texts) for k, texts in enumerate(conversations)])
    used = sorted(
        ((cpu - threads_before.get(thread, 0.0), thread) for thread, cpu in thread_cpu_s(server.pids).items()),
        reverse=True,
    )
    compute = used[: server.compute_threads]
    result.compute_cpu_s = sum(cpu for cpu, _ in compute)
    for name, pid in zip(server.names, server.pids, strict=True):
        own_compute = sum(cpu for cpu, (owner, _) in compute if owner == pid)
        # Each thread's time is rounded down to a clock tick, the process's is not: never below zero.
        result.other_cpu_parts[name] = max(process_cpu_s([pid]) - processes_before[pid] - own_compute, 0.0)
    for name in server.services:
        result.other_cpu_parts[name] = service_cpu_s([name]) - services_before[name]
    result.other_cpu_s = sum(result.other_cpu_parts.values())
    result.machine_cpu_s = machine_cpu_s() - machine_before
    if steps_before and server.engine_steps:
        steps_after = server.engine_steps()
        result.engine_steps = {
            kind: {field: totals[field] - steps_before[kind][field] for field in totals}
            for kind, totals in steps_after.items()
        }
    return result


def _cpu_ticks(stat: Path, *, children: bool = False) -> int | None:
    """utime + stime (and, with `children`, cutime + cstime: the CPU of children it has reaped) from a
    /proc stat file; None if the process or thread is gone."""
    try:
        fields = stat.read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(int(v) for v in fields[11 : 15 if children else 13])  # fields 14-17 of proc(5)


def process_cpu_s(pids: Sequence[int]) -> float:
    """User and system CPU seconds the processes have used so far, threads that already ended included (the
    web runs each request's database work on a thread of its own)."""
    return sum(_cpu_ticks(Path(f"/proc/{pid}/stat")) or 0 for pid in pids) / CLOCK_TICKS


def thread_cpu_s(pids: Sequence[int]) -> dict[tuple[int, str], float]:
    """User and system CPU seconds each live thread of the processes has used so far, by (pid, thread id)."""
    used = {}
    for pid in pids:
        for task in Path(f"/proc/{pid}/task").iterdir():
            if (ticks := _cpu_ticks(task / "stat")) is not None:
                used[(pid, task.name)] = ticks / CLOCK_TICKS
    return used


def service_cpu_s(names: Sequence[str]) -> float:
    """CPU seconds used so far by every process with one of these names, with the children they reaped (a
    Postgres backend that exits counts in its postmaster's)."""
    if not names:
        return 0.0
    ticks = 0
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                name = (proc / "comm").read_text().strip()
            except OSError:
                continue
            if name in names:
                ticks += _cpu_ticks(proc / "stat", children=True) or 0
    return ticks / CLOCK_TICKS


def machine_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (everything but idle and iowait), all cores."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


@dataclass(frozen=True)
class Scenario:
    sessions: int
    turns: int

    @property
    def label(self) -> str:
        return f"{self.sessions}x{self.turns}"


def compare(
    ours: Contender,
    theirs: Contender,
    scenarios: Sequence[Scenario],
    conversations: Sequence[list[str]],
    *,
    repeats: int,
    max_tokens: int,
    ignore_eos: bool,
    run: str,
    progress: Callable[[str], None],
) -> dict[str, dict[str, Figures]]:
    """Each scenario `repeats` times on both servers, interleaved (A B, then B A, ...), each pair on
    conversations of its own so that no server meets a prompt it has cached from an earlier pair.
    Returns {scenario: {server name: [figures of each repeat]}}."""
    results: dict[str, dict[str, list[dict[str, float]]]] = {
        s.label: {ours.name: [], theirs.name: []} for s in scenarios
    }
    offset = 0
    for r in range(repeats):
        for scenario in scenarios:
            chosen = conversations[offset : offset + scenario.sessions]
            if len(chosen) < scenario.sessions:
                raise ValueError(f"Only {len(conversations)} conversations are long enough for this benchmark.")
            offset += scenario.sessions
            for side in alternating(ours, theirs, r):
                progress(f"repeat {r + 1}/{repeats}, {scenario.label}: {side.name}")
                # Sessions of their own on each side: two stacks on one database must not share conversations.
                tag = f"bench-{run}-{r}-{scenario.label}-{side.name}"
                with side.serving() as server:
                    replayed = replay(
                        server, chosen, turns=scenario.turns, max_tokens=max_tokens, ignore_eos=ignore_eos, tag=tag
                    )
                if replayed.errors:
                    raise RuntimeError(f"{side.name} failed {len(replayed.errors)} turns: {replayed.errors[0]}")
                results[scenario.label][side.name].append(replayed.figures())
            check_same_prompts(results[scenario.label], ours.name, theirs.name)
    return results


def check_same_prompts(figures: dict[str, Figures], ours: str, theirs: str) -> None:
    """Both servers replayed the same conversations: their prompts must be about the same size (replies
    differ a little). Far apart, one of them rendered the chat differently, and the comparison means nothing."""
    sent = {name: figures[name][-1]["prompt_tokens"] for name in (ours, theirs)}
    if not 0.5 <= sent[theirs] / max(sent[ours], 1) <= 2:
        raise RuntimeError(
            f"{ours} counted {sent[ours]:,.0f} prompt tokens and {theirs} {sent[theirs]:,.0f} for the same "
            "conversations: one of them renders the chat differently (llama-server's chat template?)"
        )


# Ratios as llama-server / this stack for times (above 1: this stack is faster), this stack / llama-server
# for the cache hit (above 1: this stack reuses more).
RATIOS = {
    "wall_ratio": ("wall_s", False),
    "ttft_p50_ratio": ("ttft_p50_ms", False),
    "ttft_p90_ratio": ("ttft_p90_ms", False),
    "cpu_per_token_ratio": ("cpu_ms_per_token", False),
    "compute_cpu_ratio": ("compute_cpu_ms_per_token", False),
    "cache_hit_ratio": ("cache_hit", True),
}


def summarise(results: dict[str, dict[str, Figures]], ours: str, theirs: str) -> dict:
    """Per scenario: each server's median figures, and each ratio's median and range over the pairs."""
    summary: dict = {}
    for label, by_server in results.items():
        for server, runs in by_server.items():
            for key in runs[0]:
                summary[f"{server}_{key}_{label}"] = statistics.median(run[key] for run in runs)
        for name, (key, ours_over_theirs) in RATIOS.items():
            pairs = zip(by_server[ours], by_server[theirs], strict=True)
            ratios = [_ratio(a[key], b[key]) if ours_over_theirs else _ratio(b[key], a[key]) for a, b in pairs]
            summary |= paired(f"{name}_{label}", ratios)
    return summary


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else math.nan
