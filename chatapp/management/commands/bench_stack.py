import json
import os
import shlex
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from itertools import islice
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError

from chatapp import quotas
from chatapp.api.keys import api_key_create
from chatapp.datasets import chitchat_conversations
from chatapp.stack_bench import (
    ENGINE_FIGURES,
    RATIOS,
    Contender,
    Scenario,
    Server,
    compare,
    other_cpu_parts,
    summarise,
    warm_up,
)
from chatapp.stack_processes import Stack, free_port, wait_for_http
from inference.benchmark import rounded
from inference.config import EngineConfig
from inference.model_files import DEFAULT_MODEL, PACKAGED, ModelNotFound, resolve_model
from router.models import Node

LOG_DIR = Path(settings.BASE_DIR) / "var" / "bench-stack"
LLAMA_SERVER = Path(settings.BASE_DIR) / "var" / "llama-server"
REPEAT_PENALTY = 1.1  # the node's default; llama-server is asked for the same
# DEBUG keeps every SQL query in memory: not what a server runs. Off, secure cookies would redirect the
# replay's plain http to https, unless the environment (a .env) turned them off: the replay is local http.
PRODUCTION = {"DEBUG": "off", "SECURE_COOKIES": "off"}
TARGETS = {"wall_ratio": ">= 1.0", "ttft_p50_ratio": ">= 1.0", "cache_hit_ratio": ">= 1.0"}


class Command(BaseCommand):
    help = (
        "Replay chat sessions through this stack's OpenAI API (a node and a web process it starts) and through "
        "llama.cpp's llama-server (or this stack from another checkout, --baseline) on the same model and cores, "
        "interleaved, and print the ratios."
    )

    def add_arguments(self, parser):
        parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(PACKAGED), help="The model both serve.")
        parser.add_argument(
            "--scenarios", default="8x12,32x10", help="Comma-separated SESSIONSxTURNS replays (default: 8x12,32x10)."
        )
        parser.add_argument("--repeats", type=int, default=3, help="Interleaved pairs per scenario (at least 3).")
        parser.add_argument("--max-tokens", type=int, default=32, help="Longest reply (greedy).")
        parser.add_argument(
            "--ignore-eos", action="store_true", help="Every reply runs to --max-tokens (both servers support it)."
        )
        parser.add_argument("--threads", type=int, default=2, help="CPU threads for each server's llama.cpp.")
        parser.add_argument("--slots", type=int, default=16, help="Sequences decoded at once by each server.")
        parser.add_argument("--n-ctx", type=int, default=2048, help="Context per session (per slot).")
        parser.add_argument("--llama-server", default=str(LLAMA_SERVER), help="The binary (make llama-server).")
        parser.add_argument(
            "--llama-server-args",
            default="",
            metavar="ARGS",
            help=(
                'More arguments for llama-server, in one string: "-fa off" runs it without flash attention, as '
                "the node runs by default (BATCH_INVARIANT turns it off); without it llama-server makes its own "
                "choice, as its users run it: on."
            ),
        )
        parser.add_argument(
            "--baseline",
            metavar="DIR",
            help=(
                "Compare with this product's stack run from another checkout (an A/B of two commits: "
                "`git worktree add DIR REV`) instead of llama-server. It uses this Python and database, so it "
                "needs the same migrations. Each replay starts its stack afresh, on either side."
            ),
        )
        parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")

    def handle(self, *args, **o):
        scenarios = _scenarios(o["scenarios"])
        if o["repeats"] < 1:
            raise CommandError("--repeats must be at least 1.")
        baseline = _baseline(o["baseline"]) if o["baseline"] else None
        if baseline is None and not Path(o["llama_server"]).is_file():
            raise CommandError(f"No llama-server at {o['llama_server']}: run `make llama-server` first.")
        try:
            model = resolve_model(name=o["model"])
        except ModelNotFound as exc:
            raise CommandError(str(exc)) from exc
        turns = max(s.turns for s in scenarios)
        needed = o["repeats"] * sum(s.sessions for s in scenarios)
        conversations = list(islice(chitchat_conversations(min_messages=2 * turns), needed))
        run = uuid.uuid4().hex[:8]
        user, _ = User.objects.get_or_create(username="benchstack")
        quotas.grant_unlimited_use(user)
        _, key = api_key_create(owner=user, name=f"bench_stack {run}")
        stack = Stack(LOG_DIR)
        try:
            if baseline is None:
                ours = Contender.running(self._stack_server(stack, "stack", f"bench-{run}", key, model, o))
                theirs = Contender.running(self._llama_server(stack, model, o))
            else:
                ours, theirs = (
                    Contender(name, partial(self._fresh_stack, name, root, run, key, model, o))
                    for name, root in (("stack", Path(settings.BASE_DIR)), ("baseline", baseline))
                )
            results = compare(
                ours,
                theirs,
                scenarios,
                conversations,
                repeats=o["repeats"],
                max_tokens=o["max_tokens"],
                ignore_eos=o["ignore_eos"],
                run=run,
                progress=(lambda m: None) if o["json"] else (lambda m: self.stderr.write(f"... {m}")),
            )
        except (ValueError, RuntimeError) as exc:
            raise CommandError(f"{exc} (logs in {LOG_DIR})") from exc
        finally:
            stack.stop()
        summary = summarise(results, ours.name, theirs.name)
        settings_used = {k: o[k] for k in ("model", "repeats", "max_tokens", "ignore_eos", "threads", "slots", "n_ctx")}
        settings_used["against"] = str(baseline) if baseline else f"llama-server {o['llama_server_args']}".strip()
        if o["json"]:
            self.stdout.write(json.dumps(settings_used | {k: rounded(v) for k, v in summary.items()}))
        else:
            self._table(summary, scenarios, settings_used, theirs.name)

    def _stack_server(self, stack: Stack, name: str, node_name: str, key: str, model, o) -> Server:
        """This product's stack (one node, one web process) from `stack`'s checkout, up and idle."""
        Node.objects.update(status=Node.Status.DOWN)  # only this node takes the replay's turns
        node_env = PRODUCTION | {
            "N_THREADS": str(o["threads"]),
            "MAX_CONCURRENT": str(o["slots"]),
            # As many KV streams as llama-server has slots; other sessions spill to RAM, as its slots do.
            "MAX_RESIDENT_SESSIONS": str(o["slots"]),
            "N_CTX": str(o["n_ctx"]),
            "REPEAT_PENALTY": str(REPEAT_PENALTY),
            # Idle sessions go to the disk tier only when they must (spilled, drained, at a shutdown): the stack
            # stays up through llama-server's replays, and writing its sessions then (96 files of 12-20 MB in a
            # 32x10 run) took CPU from llama-server's side.
            "KV_DISK_IDLE_S": "0",
        }
        node = stack.node(node_name, node_env, label="node", model=model.name)
        port = free_port()
        web = stack.web(port, PRODUCTION | {"CHAT_QUEUE_PER_SLOT": "4"})
        stack.wait_for_nodes(node_name, 1)
        server = Server(
            name,
            f"http://127.0.0.1:{port}",
            model.name,
            (node.pid, web.pid),
            ("node", "web"),
            key=key,
            compute_threads=o["threads"],
            # Nothing else uses them during the replay: their CPU is the stack's.
            services=("postgres", "redis-server"),
            engine_steps=partial(stack.node_steps, node_name),
        )
        warm_up(server, f"{node_name}-warm-up")
        return server

    @contextmanager
    def _fresh_stack(self, name: str, root: Path, run: str, key: str, model, o) -> Iterator[Server]:
        """A stack from `root`'s checkout for one replay, stopped after it: two stacks on one database must
        not be up at once, or either web could send a turn to the other's node."""
        stack = Stack(LOG_DIR / name, root=root)
        try:
            yield self._stack_server(stack, name, f"bench-{run}-{name}-{uuid.uuid4().hex[:4]}", key, model, o)
        finally:
            stack.stop()

    def _llama_server(self, stack: Stack, model, o) -> Server:
        """llama.cpp's own server on the same model, threads, slots and context, up and idle."""
        port = free_port()
        # A forced template family is one of llama.cpp's built-in templates: with Jinja on, llama-server would
        # take its name for a Jinja template and send every conversation as that one word.
        template = ["--no-jinja", "--chat-template", model.chat_template] if model.chat_template else ["--jinja"]
        # The node's weight layout: BATCH_INVARIANT (on by default) turns llama.cpp's repacked CPU weights off.
        # (On a CPU with AMX, llama-server with repacked weights crashed loading SmolLM2's Q4_1 file.)
        layout = ["--no-repack"] if EngineConfig().BATCH_INVARIANT else []
        llama = stack.spawn(
            "llama-server",
            [
                o["llama_server"],
                *("-m", str(model.path), "--host", "127.0.0.1", "--port", str(port)),
                *("-t", str(o["threads"]), "-tb", str(o["threads"]), "-np", str(o["slots"])),
                *("-c", str(o["slots"] * o["n_ctx"]), "--swa-full", *template, *layout),
                *shlex.split(o["llama_server_args"]),
            ],
            # As its users run it: libgomp's own spin count, not the one `inference/__init__.py` sets.
            {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"},
        )
        wait_for_http(f"http://127.0.0.1:{port}/health", llama, LOG_DIR / "llama-server.log")
        server = Server(
            "llama-server",
            f"http://127.0.0.1:{port}",
            model.name,
            (llama.pid,),
            ("llama-server",),
            body={"repeat_penalty": REPEAT_PENALTY, "repeat_last_n": 64},
            compute_threads=o["threads"],
        )
        warm_up(server, "bench-llama-server-warm-up")
        return server

    def _table(self, summary: dict, scenarios: list[Scenario], used: dict, other: str) -> None:
        self.stdout.write(", ".join(f"{k} {v}" for k, v in used.items()))
        figures = ["wall_s", "ttft_p50_ms", "ttft_p90_ms", "cache_hit", "cpu_ms_per_token"]
        figures += ["compute_cpu_ms_per_token", "other_cpu_ms_per_token", "machine_cpu_ms_per_token"]
        figures += ["machine_idle_share"]
        for scenario in scenarios:
            label = scenario.label
            self.stdout.write(f"\n{label} (medians)          {'stack':>12} {other:>13}")
            for figure in figures:
                ours, theirs = summary[f"stack_{figure}_{label}"], summary[f"{other}_{figure}_{label}"]
                self.stdout.write(f"  {figure:28} {ours:12.3f} {theirs:13.3f}")
            for figure in ENGINE_FIGURES:  # this stack's node counts them; llama-server does not
                values = [summary.get(f"{side}_{figure}_{label}") for side in ("stack", other)]
                if values[0] is not None:
                    shown = [f"{value:.3f}" if value is not None else "-" for value in values]
                    self.stdout.write(f"  {figure:28} {shown[0]:>12} {shown[1]:>13}")
            for side in ("stack", other):
                parts = sorted(other_cpu_parts(summary, side, label).items(), key=lambda part: -part[1])
                self.stdout.write(f"  other CPU ms a token, {side}: " + ", ".join(f"{n} {ms:.3f}" for n, ms in parts))
            self.stdout.write(f"  {'ratio':28} {'median':>12} {'range':>13}  target")
            for name in RATIOS:
                low, high = summary[f"{name}_{label}_range"]
                median = summary[f"{name}_{label}"]
                target = TARGETS.get(name, "") if other == "llama-server" else ""
                self.stdout.write(f"  {name:28} {median:12.3f} {low:6.3f}-{high:<6.3f}  {target}")


def _baseline(directory: str) -> Path:
    """Another checkout of this project whose code can run on this database (the same migrations)."""
    root = Path(directory).resolve()
    if not (root / "manage.py").is_file():
        raise CommandError(f"--baseline {directory}: no manage.py there (make one with `git worktree add DIR REV`).")
    if root == Path(settings.BASE_DIR).resolve():
        raise CommandError("--baseline is this checkout: give another one (`git worktree add DIR REV`).")
    mine, theirs = _migrations(Path(settings.BASE_DIR)), _migrations(root)
    if mine != theirs:
        differ = sorted(mine ^ theirs)
        shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
        raise CommandError(f"--baseline {directory} has other migrations than this checkout: {shown}.")
    return root


def _migrations(root: Path) -> set[str]:
    return {f"{path.parent.parent.name}/{path.name}" for path in root.glob("*/migrations/0*.py")}


def _scenarios(text: str) -> list[Scenario]:
    try:
        scenarios = [Scenario(*(int(n) for n in part.split("x"))) for part in text.split(",")]
    except (TypeError, ValueError) as exc:
        raise CommandError(f"--scenarios must look like 8x12,32x10; got {text!r}.") from exc
    if any(s.sessions < 1 or s.turns < 1 for s in scenarios):
        raise CommandError("Each scenario needs at least one session and one turn.")
    return scenarios
