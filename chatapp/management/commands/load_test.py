import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from functools import partial
from itertools import islice
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from chatapp import loadtest, loadtest_streams, quotas, services
from chatapp.api.keys import api_key_create
from chatapp.datasets import chitchat_conversations
from chatapp.turns import admission
from inference.benchmark import run_parallel
from router.models import Node


class Command(BaseCommand):
    help = (
        "Load test: concurrent sessions stream replies through a web process (uvicorn) and inference nodes "
        "that this command starts, then Postgres is audited for lost or doubled messages. Prints turns/s, "
        "TTFT p50/p99, busy answers, errors and the processes' memory."
    )

    def add_arguments(self, parser):
        parser.add_argument("--sessions", type=int, default=32)
        parser.add_argument("--nodes", type=int, default=2)
        parser.add_argument("--duration", type=float, default=180, help="Seconds of load.")
        parser.add_argument("--max-tokens", type=int, default=32, help="Longest reply.")
        parser.add_argument("--node-slots", type=int, default=8, help="Generations per node (MAX_CONCURRENT).")
        parser.add_argument(
            "--queue-per-slot", type=int, default=1, help="Unfinished turns a node takes per slot before 429."
        )
        parser.add_argument("--threads-per-node", type=int, default=1, help="llama.cpp threads (N_THREADS).")
        parser.add_argument("--spill-mb", type=int, default=256, help="Host RAM per node for spilled KV state.")
        parser.add_argument(
            "--open-streams",
            type=int,
            default=500,
            help="Browser event streams held open at once on a few long replies, before the load (0: skip).",
        )
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, **o):
        run = uuid.uuid4().hex[:8]
        prefix = f"load-{run}-"
        node_env = {
            "MAX_CONCURRENT": str(o["node_slots"]),
            "N_THREADS": str(o["threads_per_node"]),
            "MAX_RESIDENT_SESSIONS": str(max(o["node_slots"], o["sessions"] // o["nodes"] + 1)),
            "TEMPERATURE": "0",
            "SPILL_BUDGET_MB": str(o["spill_mb"]),
        }
        Node.objects.update(status=Node.Status.DOWN)  # only this test's nodes take its turns
        processes: dict[str, subprocess.Popen] = {}
        try:
            for k in range(o["nodes"]):
                processes[f"node-{k}"] = _spawn(["run_node", "--name", f"load-{run}-{k}"], node_env, f"node-{k}")
            port = _free_port()
            web_env = {"CHAT_QUEUE_PER_SLOT": str(o["queue_per_slot"])}
            processes["web"] = _spawn_web(port, web_env)
            _wait_for_nodes(prefix, o["nodes"], processes)
            self._progress(o, f"web on port {port}, {o['nodes']} nodes; {o['sessions']} sessions, {o['duration']:.0f}s")
            held = self._hold_streams(run, port, o) if o["open_streams"] else {}
            result = held | self._load(run, prefix, port, processes, o)
        finally:
            for process in processes.values():
                process.terminate()
            for process in processes.values():
                process.wait(timeout=30)
        if o["json"]:
            self.stdout.write(json.dumps(result, default=str))
        else:
            for key, value in result.items():
                self.stdout.write(f"{key:40} {value}")
        lost = result["turns_stored"] - result["turns_done"] - result["turns_failed"]
        lost += result.get("streams_refused_or_cut", 0)
        if lost or result["replies_without_turn"] or result["conversations_with_unmatched_messages"]:
            raise CommandError("Messages were lost or doubled: see the figures above.")

    def _load(self, run: str, prefix: str, port: int, processes: dict[str, subprocess.Popen], o) -> dict:
        user, _ = User.objects.get_or_create(username="loadtest")
        quotas.grant_unlimited_use(user)
        _, key = api_key_create(owner=user, name=f"load test {run}")
        conversations = list(islice(chitchat_conversations(min_messages=12), o["sessions"]))
        clients = [loadtest.ClientStats() for _ in range(o["sessions"])]
        stop = threading.Event()
        memory = loadtest.sample_memory({name: p.pid for name, p in processes.items()}, stop)
        started = time.monotonic()
        deadline = started + o["duration"]
        run_parallel(
            [
                partial(
                    loadtest.run_client,
                    url=f"http://127.0.0.1:{port}",
                    key=key,
                    session=f"{prefix}{k}",
                    texts=conversations[k][0::2],
                    deadline=deadline,
                    max_tokens=o["max_tokens"],
                    stats=clients[k],
                )
                for k in range(o["sessions"])
            ]
        )
        seconds = time.monotonic() - started
        stop.set()
        self._progress(o, "load done; waiting for unfinished turns, then auditing Postgres")
        unfinished = loadtest.wait_drained(prefix)
        return loadtest.summary(clients, seconds, memory, loadtest.audit(prefix, clients)) | {"unfinished": unfinished}

    def _hold_streams(self, run: str, port: int, o) -> dict:
        user, _ = User.objects.get_or_create(username="loadtest")
        quotas.grant_unlimited_use(user)
        turns = [
            admission.turn_start(
                conversation=services.conversation_create(owner=user, title=f"load test {run}: streams {k}"),
                text="Tell me a long story about a lighthouse keeper and a storm.",
                # 256 tokens each, so that every stream is still open when the last reader joins.
                sampling={"max_tokens": 256, "temperature": 0, "ignore_eos": True},
            )
            for k in range(4 * o["nodes"])
        ]
        self._progress(o, f"holding {o['open_streams']} event streams open on {len(turns)} replies")
        return loadtest_streams.hold_streams(port=port, user=user, turns=turns, readers=o["open_streams"])

    def _progress(self, o, message: str) -> None:
        if not o["json"]:
            self.stderr.write(f"... {message}")


LOG_DIR = Path(settings.BASE_DIR) / "var" / "load-test"


def _environment(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment, with the database it is using (a test database, say) and `extra`."""
    db = connection.settings_dict
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    url = f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    return os.environ | extra | {"DATABASE_URL": url}


def _spawn(args: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with (LOG_DIR / f"{log_name}.log").open("w") as log:
        return subprocess.Popen(  # noqa: S603 (our own manage.py, arguments built here)
            [sys.executable, "manage.py", *args],
            cwd=settings.BASE_DIR,
            env=_environment(env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )


def _spawn_web(port: int, env: dict[str, str]) -> subprocess.Popen:
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with (LOG_DIR / "web.log").open("w") as log:
        process = subprocess.Popen(  # noqa: S603 (our own web process, arguments built here)
            [sys.executable, "-m", "uvicorn", "chatapp.asgi:application", "--port", str(port), "--no-access-log"],
            cwd=settings.BASE_DIR,
            env=_environment(env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/login/", timeout=1)
            return process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise CommandError(f"The web process did not start; see {LOG_DIR / 'web.log'}.") from None
            time.sleep(0.2)


def _wait_for_nodes(prefix: str, count: int, processes: dict[str, subprocess.Popen], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes.values()):
            raise CommandError(f"A process exited early; see the logs in {LOG_DIR}.")
        ready = [
            name for name in (f"node-{k}" for k in range(count)) if " ready." in (LOG_DIR / f"{name}.log").read_text()
        ]
        if len(ready) == count and Node.objects.filter(name__startswith=prefix, status=Node.Status.UP).count() == count:
            return
        time.sleep(0.5)
    raise CommandError(f"The nodes did not start within {timeout:.0f}s; see the logs in {LOG_DIR}.")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
