"""Celery tasks: thin adapters from a turn id to a service."""

import threading

from celery import Task
from celery.signals import worker_shutting_down

from chatapp.celery import app
from chatapp.generation import turn_generate
from chatapp.node_identity import incarnation
from inference.engine import get_engine

_stopping = threading.Event()


@worker_shutting_down.connect
def _start_nothing_new(**kwargs) -> None:
    """A node shutting down finishes what it runs but starts nothing new: the turns it had received but
    not started stay queued, and its hand-off sends them to another node (run_node)."""
    _stopping.set()


@app.task(name="chatapp.generate", bind=True)
def generate(self: Task, turn_id: int, attempt: int = 0) -> None:
    if _stopping.is_set():
        return
    # The worker runs as `<node>@<host>` (see run_node), so its node name is the hostname's first part.
    node = (self.request.hostname or "unknown").split("@", 1)[0]
    turn_generate(turn_id=turn_id, attempt=attempt, engine=get_engine(), node=node, incarnation=incarnation())


@app.task(name="chatapp.end_sessions")
def end_sessions(session_keys: list[str]) -> None:
    """Forget these sessions' cached state on this node (their conversation was deleted)."""
    engine = get_engine()
    for key in session_keys:
        engine.end_session(key)
