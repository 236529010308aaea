"""A node's heartbeat thread: report the engine's stats and sessions to the router (and its load to the
node's history, every ROUTER_NODE_SAMPLE_SECONDS), and reap orphaned turns.

Every node reaps: the first live node to notice a peer's missed heartbeats marks it unresponsive and
sends that peer's unfinished turns to healthy nodes (`chatapp.turns.recovery`). An idle node also sends
again its own turns that stayed queued too long: their Celery task was lost with a broker that restarted.
"""

import dataclasses
import logging
import threading
import time

from django.conf import settings
from django.db import close_old_connections

from chatapp.turns.recovery import turns_reap, turns_resend_lost
from inference.engine import Engine
from router.models import Node
from router.services import ServedModel, node_heartbeat

logger = logging.getLogger(__name__)
SESSIONS_LISTED = 200  # the sessions a heartbeat names, with where each is held (the node's admin page)


class Heartbeat:
    def __init__(self, *, name: str, incarnation: str, capacity: int, engine: Engine, served: ServedModel) -> None:
        self.name = name
        self.served = served
        self.incarnation = incarnation
        self.capacity = capacity
        self.engine = engine
        self._stop = threading.Event()
        self._next_sample = 0.0
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def beat(self) -> None:
        stats = self.engine.stats()
        now = time.monotonic()
        sample = now >= self._next_sample
        if sample:
            self._next_sample = now + settings.ROUTER_NODE_SAMPLE_SECONDS
        places = self.engine.session_places(SESSIONS_LISTED + 1)
        listed = {
            "sessions": dict(list(places.items())[:SESSIONS_LISTED]),
            "sessions_complete": len(places) <= SESSIONS_LISTED,
            "dropped": self.engine.sessions_dropped(),
        }
        status = node_heartbeat(
            name=self.name,
            capacity=self.capacity,
            stats=dataclasses.asdict(stats) | listed | {"totals": self.engine.metrics.snapshot()},
            incarnation=self.incarnation,
            served=self.served,
            sample=sample,
        )
        self.engine.set_draining(status == Node.Status.DRAINING)
        turns_reap()
        if stats.running == 0 and stats.waiting == 0:  # idle, so nothing queued for it is merely waiting
            resent = turns_resend_lost(node=self.name)
            if resent:
                logger.warning("node %s: %d queued turns had lost their task; sent again", self.name, resent)

    def _run(self) -> None:
        while not self._stop.wait(settings.ROUTER_HEARTBEAT_SECONDS):
            try:
                self.beat()
            except Exception:  # a database hiccup must not stop the heartbeat
                logger.exception("heartbeat of node %s failed", self.name)
            finally:
                close_old_connections()
