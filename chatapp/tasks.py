"""Celery tasks: thin adapters from a turn id to a service."""

from celery import Task

from chatapp.celery import app
from chatapp.generation import turn_generate
from chatapp.node_identity import incarnation
from inference.engine import get_engine


@app.task(name="chatapp.generate", bind=True)
def generate(self: Task, turn_id: int, attempt: int = 0) -> None:
    # The worker runs as `<node>@<host>` (see run_node), so its node name is the hostname's first part.
    node = (self.request.hostname or "unknown").split("@", 1)[0]
    turn_generate(turn_id=turn_id, attempt=attempt, engine=get_engine(), node=node, incarnation=incarnation())
