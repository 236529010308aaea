"""Helpers shared by tests that drive a real node."""

import time
from collections.abc import Callable
from typing import Any

from chatapp.models import Turn
from inference.types import Generation
from router.models import Node
from tests.conftest import NODE_ENV


def wait_until(condition: Callable[[], Any], timeout: float = 60, what: str = "condition") -> Any:
    """Poll until `condition()` is truthy, and return its value; fail saying `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if value := condition():
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} not met within {timeout}s")


def only_these_nodes(*names: str) -> None:
    """Route to these nodes alone: once they are up, the others are marked down (a node's heartbeat never
    undoes that). First one heartbeat period passes, so that a live node whose row a flush between tests
    removed has registered again, up, and is marked down with the rest."""
    wait_until(lambda: Node.objects.filter(name__in=names, status=Node.Status.UP).count() == len(names), what="nodes")
    time.sleep(2 * float(NODE_ENV["ROUTER_HEARTBEAT_SECONDS"]))
    Node.objects.exclude(name__in=names).update(status=Node.Status.DOWN)


def wait_for_turn(turn: Turn, timeout: float = 120) -> Turn:
    """Poll Postgres until the node has finished the turn."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        turn.refresh_from_db()
        if turn.is_finished:
            return turn
        time.sleep(0.2)
    raise AssertionError(f"turn {turn.pk} still {turn.status} after {timeout}s")


def generation(text: str = "Hi there.") -> Generation:
    """What an engine returns for a short reply."""
    return Generation(
        text=text,
        token_ids=[1, 2, 3],
        finish_reason="stop",
        prompt_tokens=10,
        cached_tokens=0,
        cache_source="none",
        queue_ms=0.0,
        prefill_ms=1.0,
        ttft_ms=1.0,
        decode_tokens_per_s=10.0,
    )
