"""The product's own processes, started by a benchmark or a load test: inference nodes and a web process
on the database this process uses, each logging to var/<run>/<name>.log."""

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from django.conf import settings
from django.core.management.base import CommandError
from django.db import connection
from django.utils import timezone

from inference import environment_for_children
from router.models import Node


class Stack:
    """Processes started for one run; `stop()` ends them all (SIGTERM, then waits). The product's processes
    run the code in `root`: this checkout, or another one (`bench_stack --baseline`) with the same Python."""

    def __init__(self, log_dir: Path, root: Path | None = None) -> None:
        self.log_dir = log_dir
        self.root = root or Path(settings.BASE_DIR)
        self.processes: dict[str, subprocess.Popen] = {}

    def node(self, name: str, env: dict[str, str], *, label: str, model: str = "") -> subprocess.Popen:
        args = ["run_node", "--name", name] + (["--model", model] if model else [])
        return self._spawn(label, [sys.executable, "manage.py", *args], env)

    def web(self, port: int, env: dict[str, str]) -> subprocess.Popen:
        """uvicorn serving the product on `port`; returns once it answers."""
        command = [sys.executable, "-m", "uvicorn", "chatapp.asgi:application", "--port", str(port), "--no-access-log"]
        process = self._spawn("web", command, env)
        wait_for_http(f"http://127.0.0.1:{port}/login/", process, self.log_dir / "web.log")
        return process

    def wait_for_nodes(self, prefix: str, count: int, timeout: float = 180) -> None:
        """Until `count` nodes named `prefix...` are consuming their queues and registered up."""
        deadline = time.monotonic() + timeout
        labels = [label for label in self.processes if label.startswith("node")]
        while time.monotonic() < deadline:
            self.check_alive()
            ready = [label for label in labels if " ready." in (self.log_dir / f"{label}.log").read_text()]
            up = Node.objects.filter(name__startswith=prefix, status=Node.Status.UP).count()
            if len(ready) == count and up == count:
                return
            time.sleep(0.5)
        raise CommandError(f"The nodes did not start within {timeout:.0f}s; see the logs in {self.log_dir}.")

    def node_steps(self, name: str, timeout: float = 10) -> dict[str, dict[str, float]]:
        """The node's decode-step totals by kind (inference.engine_metrics) from a heartbeat sent after this
        call: read while its engine is idle (before and after a replay), they are exact."""
        asked = timezone.now()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            node = Node.objects.get(name=name)
            if node.last_heartbeat and node.last_heartbeat > asked:
                return node.stats.get("totals", {}).get("steps", {})  # {} from a checkout before session 41
            time.sleep(0.2)
        raise CommandError(f"Node {name} sent no heartbeat within {timeout:.0f}s; see the logs in {self.log_dir}.")

    def check_alive(self) -> None:
        for label, process in self.processes.items():
            if process.poll() is not None:
                raise CommandError(f"{label} exited early; see {self.log_dir / f'{label}.log'}.")

    def pids(self) -> dict[str, int]:
        return {label: process.pid for label, process in self.processes.items()}

    def stop(self) -> None:
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def spawn(self, label: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        """Any other program (llama-server, say), logged like the product's processes, with `env` as its
        whole environment."""
        return self._spawn(label, command, env, product=False)

    def _spawn(self, label: str, command: list[str], env: dict[str, str], product: bool = True) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{label}.log").open("w") as log:
            process = subprocess.Popen(  # noqa: S603 (our own programs, arguments built here)
                command,
                cwd=self.root,
                env=product_environment(env) if product else env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.processes[label] = process
        return process


def product_environment(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment, with the database it is using (a test database, say) and `extra`."""
    db = connection.settings_dict
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    url = f"postgres://{auth}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"
    return environment_for_children() | extra | {"DATABASE_URL": url}


def wait_for_http(url: str, process: subprocess.Popen, log: Path, timeout: float = 120) -> None:
    """Until `url` answers 200 (llama-server's /health says 503 while it loads), or fail naming the log if
    the process dies or never does."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1)  # noqa: S310 (a local URL built here)
            return
        except OSError:  # refused, or an HTTP error status
            if process.poll() is not None or time.monotonic() > deadline:
                raise CommandError(f"{url} did not answer; see {log}.") from None
            time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
