"""Fixtures with real parts: Postgres (pytest-django's test database), Redis, the model, and a node process."""

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from django.db import connection

from chatapp.celery import app
from inference.config import EngineConfig
from inference.model_files import resolve_model_path
from tests.factories import UserFactory

ROOT = Path(__file__).resolve().parent.parent
OUTPUT_DIR = ROOT / "test-output"
# Short replies keep the suite fast; greedy decoding keeps it deterministic.
NODE_ENV = {"MAX_REPLY_TOKENS": "24", "TEMPERATURE": "0", "N_CTX": "4096", "MAX_RESIDENT_SESSIONS": "4"}


@pytest.fixture(scope="session")
def model_path() -> Path:
    return resolve_model_path(EngineConfig().MODEL_PATH)


@pytest.fixture(scope="session")
def tokenizer(model_path: Path):
    """The real model's tokenizer (vocabulary only: no weights are loaded)."""
    from llama_cpp import Llama

    return Llama(model_path=str(model_path), vocab_only=True, verbose=False)


@pytest.fixture(scope="session")
def node_process(django_db_setup, django_db_blocker) -> Iterator[str]:
    """A real inference node (`manage.py run_node`) on its own queue, using the test database."""
    name = f"test-{uuid.uuid4().hex[:8]}"
    with django_db_blocker.unblock():
        database = connection.settings_dict["NAME"]
    env = os.environ | NODE_ENV | {"DATABASE_URL": f"postgres://postgres@127.0.0.1:5432/{database}"}
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
        yield name
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _wait_until_ready(name: str, process: subprocess.Popen, log_path: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"node {name} exited with {process.returncode}:\n{log_path.read_text()[-3000:]}")
        replies = app.control.ping(timeout=0.5) or []
        if any(host.startswith(f"{name}@") for reply in replies for host in reply):
            return
        time.sleep(0.5)
    raise RuntimeError(f"node {name} did not start within {timeout}s:\n{log_path.read_text()[-3000:]}")


@pytest.fixture
def node(node_process: str, settings) -> str:
    """Route every session of this test to the test node."""
    settings.ROUTER_NODES = [node_process]
    return node_process


@pytest.fixture
def user(db):
    return UserFactory.create()


@pytest.fixture
def other_user(db):
    return UserFactory.create()
