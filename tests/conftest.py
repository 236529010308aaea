"""Fixtures with real parts: Postgres (pytest-django's test database), Redis, the model, and a node process."""

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection

from inference.batch_engine import BatchEngine
from inference.chat_format import ChatFormat
from inference.config import EngineConfig
from inference.model_files import ModelFile
from inference.tokenizer import chat_format_for
from router.models import Node
from router.services import healthy_nodes
from tests.factories import NodeFactory, UserFactory

ROOT = Path(__file__).resolve().parent.parent
OUTPUT_DIR = ROOT / "test-output"
# The suite's nodes share one disk tier of their own, new for each run.
NODE_KV_DIR = OUTPUT_DIR / "kv-cache" / uuid.uuid4().hex[:8]
# Short replies keep the suite fast; greedy decoding keeps it deterministic.
NODE_ENV = {
    "KV_DISK_PATH": str(NODE_KV_DIR),
    "MAX_REPLY_TOKENS": "24",
    "TEMPERATURE": "0",
    "N_CTX": "4096",
    "MAX_RESIDENT_SESSIONS": "4",
    "ROUTER_HEARTBEAT_SECONDS": "0.5",
    "ROUTER_NODE_TIMEOUT_SECONDS": "3",
}


@pytest.fixture(scope="session")
def model_file() -> ModelFile:
    """The model the suite runs: the default one, unless MODEL or MODEL_PATH says otherwise."""
    return EngineConfig().model_file()


@pytest.fixture(scope="session", autouse=True)
def _remove_node_kv_dir() -> Iterator[None]:
    yield
    shutil.rmtree(NODE_KV_DIR, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def _flush_retries_a_deadlock() -> Iterator[None]:
    """A transactional test ends by truncating every table while the suite's live node processes still
    heartbeat and reap in their own transactions; Postgres can then abort the TRUNCATE as a deadlock. That
    is a race of the harness (the product never truncates), so the flush is tried again, as a deadlock's
    loser should be."""
    from django.db import OperationalError
    from django.test import TransactionTestCase

    flush = TransactionTestCase._fixture_teardown  # type: ignore[attr-defined]

    def retrying(self) -> None:
        for attempt in range(3):
            try:
                return flush(self)
            except Exception as exc:  # flush wraps the deadlock in a CommandError
                if (
                    attempt == 2
                    or not isinstance(exc.__cause__, OperationalError)
                    or "deadlock" not in str(exc.__cause__)
                ):
                    raise
                time.sleep(0.5)

    TransactionTestCase._fixture_teardown = retrying  # type: ignore[attr-defined]
    yield
    TransactionTestCase._fixture_teardown = flush  # type: ignore[attr-defined]


# What the in-process test engines run with: small, so that spilling and chunked prefill happen quickly.
SMALL_ENGINE = EngineConfig(N_CTX=1024, MAX_RESIDENT_SESSIONS=4, MAX_CONCURRENT=8, STEP_TOKEN_BUDGET=64, N_THREADS=2)


@pytest.fixture(scope="session")
def engine(model_file: ModelFile, tmp_path_factory: pytest.TempPathFactory) -> Iterator[BatchEngine]:
    """An engine in the test process, with a disk tier of its own."""
    engine = BatchEngine(SMALL_ENGINE.replace(KV_DISK_PATH=str(tmp_path_factory.mktemp("kv"))))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def tokenizer(model_file: ModelFile):
    """The real model's tokenizer (vocabulary only: no weights are loaded)."""
    from llama_cpp import Llama

    return Llama(model_path=str(model_file.path), vocab_only=True, verbose=False)


@pytest.fixture(scope="session")
def chat_format(model_file: ModelFile) -> ChatFormat:
    """The model's chat format, as the web process builds it (vocabulary only)."""
    return chat_format_for(model_file)


def start_node(name: str, database: str, **env: str) -> subprocess.Popen:
    """A real inference node (`manage.py run_node`) on its own queue, using the test database."""
    env = os.environ | NODE_ENV | env | {"DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{database}"}
    OUTPUT_DIR.mkdir(exist_ok=True)
    log_path = OUTPUT_DIR / f"node-{name}.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "manage.py", "run_node", "--name", name, "--loglevel", "INFO"],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_until_ready(name, process, log_path)
    except BaseException:
        stop_node(process)
        raise
    return process


def stop_node(process: subprocess.Popen, timeout: float = 20) -> None:
    """SIGTERM (a warm shutdown: the node finishes what it runs), then SIGKILL after `timeout` seconds."""
    process.terminate()
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _wait_until_ready(name: str, process: subprocess.Popen, log_path: Path, timeout: float = 120) -> None:
    """Until the node's Celery worker says it is consuming (`<name>@<host> ready.`), on whichever broker."""
    ready = re.compile(rf"{re.escape(name)}@\S+ ready\.")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"node {name} exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        if ready.search(log_path.read_text()):
            return
        time.sleep(0.5)
    raise RuntimeError(f"node {name} did not start within {timeout}s:\n{log_path.read_text()[-3000:]}")


# The libpq options the product's connections are made with (DB_IDLE_IN_TRANSACTION_TIMEOUT_S among them),
# read before the fixture below changes the suite's own.
PRODUCT_DB_OPTIONS: str = connection.settings_dict.get("OPTIONS", {}).get("options", "")


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix: None) -> None:
    """The suite's own connection runs without DB_IDLE_IN_TRANSACTION_TIMEOUT_S (a later `-c` wins). That
    timeout frees the row locks of a product process frozen mid-transaction; here pytest-django's `db` wraps
    a whole test in one transaction, which waits on the model, Hypothesis or a loaded machine between its
    statements (a full run at 1.5 s ended the fuzz test's; at 5 s, a slow CI machine ended the summaries
    test's). The processes the tests start (nodes, web) keep it."""
    options = connection.settings_dict.setdefault("OPTIONS", {})
    options["options"] = f"{PRODUCT_DB_OPTIONS} -c idle_in_transaction_session_timeout=0".strip()


@pytest.fixture(scope="session")
def test_database(django_db_setup, django_db_blocker) -> str:
    with django_db_blocker.unblock():
        return connection.settings_dict["NAME"]


@pytest.fixture(scope="session")
def node_process(test_database: str) -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:8]}"
    process = start_node(name, test_database)
    yield name
    stop_node(process)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_web(
    database: str, *, port: int | None = None, log_name: str = "web", env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """The web process as deployed (uvicorn, ASGI) on a free port, using the test database; (process, url)."""
    port = port or free_port()
    env = os.environ | (env or {}) | {"DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{database}"}
    OUTPUT_DIR.mkdir(exist_ok=True)
    log_path = OUTPUT_DIR / f"{log_name}.log"
    with log_path.open("a") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "chatapp.asgi:application", "--host", "127.0.0.1", "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/login/", timeout=1)
            return process, url
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                stop_node(process)
                raise RuntimeError(f"uvicorn did not start:\n{log_path.read_text()[-3000:]}") from None
            time.sleep(0.2)


@pytest.fixture(scope="session")
def asgi_server(test_database: str) -> Iterator[str]:
    process, url = start_web(test_database)
    yield url
    stop_node(process)


@pytest.fixture
def node(node_process: str) -> str:
    """The test node, registered and healthy (tables flushed by an earlier test refill at its next heartbeat)."""
    Node.objects.exclude(name=node_process).update(status=Node.Status.DOWN)
    deadline = time.monotonic() + 15
    while not any(n.name == node_process for n in healthy_nodes()):
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {node_process} is not registered as healthy")
        time.sleep(0.2)
    return node_process


@pytest.fixture
def idle_node(db) -> Node:
    """A healthy node that nothing consumes: turns are routed and queued but never run (on_commit never fires here)."""
    Node.objects.update(status=Node.Status.DOWN)
    return NodeFactory.create(name="idle")


@pytest.fixture
def user(db):
    return UserFactory.create()


@pytest.fixture
def other_user(db):
    return UserFactory.create()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """A failing test that ran its own processes shows the end of their logs: a node's side of a failure
    is otherwise lost with the CI machine."""
    started = time.time()
    try:
        return (yield)
    except BaseException:
        logs = sorted(OUTPUT_DIR.glob("*.log")) if OUTPUT_DIR.is_dir() else []
        for log in (path for path in logs if path.stat().st_mtime >= started):
            tail = log.read_text(errors="replace").splitlines()[-40:]
            item.add_report_section("call", log.name, "\n".join(tail))
        raise
