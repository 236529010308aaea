"""Helpers shared by tests that drive a real node."""

import time

from chatapp.models import Turn


def wait_for_turn(turn: Turn, timeout: float = 120) -> Turn:
    """Poll Postgres until the node has finished the turn."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        turn.refresh_from_db()
        if turn.is_finished:
            return turn
        time.sleep(0.2)
    raise AssertionError(f"turn {turn.pk} still {turn.status} after {timeout}s")
