import json
import threading
import time
import uuid
from functools import partial
from itertools import islice
from pathlib import Path

from django.conf import settings
from django.contrib.auth.models import User
from django.core.management.base import BaseCommand, CommandError

from chatapp import loadtest, loadtest_streams, quotas, services
from chatapp.api.keys import api_key_create
from chatapp.datasets import chitchat_conversations
from chatapp.stack_processes import Stack, free_port
from chatapp.turns import admission
from inference.benchmark import run_parallel
from router.models import Node

LOG_DIR = Path(settings.BASE_DIR) / "var" / "load-test"


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
        stack = Stack(LOG_DIR)
        try:
            for k in range(o["nodes"]):
                stack.node(f"load-{run}-{k}", node_env, label=f"node-{k}")
            port = free_port()
            stack.web(port, {"CHAT_QUEUE_PER_SLOT": str(o["queue_per_slot"])})
            stack.wait_for_nodes(prefix, o["nodes"])
            self._progress(o, f"web on port {port}, {o['nodes']} nodes; {o['sessions']} sessions, {o['duration']:.0f}s")
            held = self._hold_streams(run, port, o) if o["open_streams"] else {}
            result = held | self._load(run, prefix, port, stack, o)
        finally:
            stack.stop()
        if o["json"]:
            self.stdout.write(json.dumps(result, default=str))
        else:
            for key, value in result.items():
                self.stdout.write(f"{key:40} {value}")
        lost = result["turns_stored"] - result["turns_done"] - result["turns_failed"]
        lost += result.get("streams_refused_or_cut", 0)
        if lost or result["replies_without_turn"] or result["conversations_with_unmatched_messages"]:
            raise CommandError("Messages were lost or doubled: see the figures above.")

    def _load(self, run: str, prefix: str, port: int, stack: Stack, o) -> dict:
        user, _ = User.objects.get_or_create(username="loadtest")
        quotas.grant_unlimited_use(user)
        _, key = api_key_create(owner=user, name=f"load test {run}")
        conversations = list(islice(chitchat_conversations(min_messages=12), o["sessions"]))
        clients = [loadtest.ClientStats() for _ in range(o["sessions"])]
        stop = threading.Event()
        memory = loadtest.sample_memory(stack.pids(), stop)
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
