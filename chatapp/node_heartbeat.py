"""A node's heartbeat thread: report the engine's stats to the router, and reap dead peers.

Every node reaps: the first live node to notice a peer's missed heartbeats
marks it down and re-sends that peer's unfinished turns to healthy nodes.
"""

import dataclasses
import logging
import threading

from django.conf import settings
from django.db import close_old_connections

from chatapp.services import turns_redispatch
from inference.engine import Engine
from router.services import node_heartbeat, nodes_reap

logger = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, *, name: str, capacity: int, engine: Engine) -> None:
        self.name = name
        self.capacity = capacity
        self.engine = engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def beat(self) -> None:
        node_heartbeat(name=self.name, capacity=self.capacity, stats=dataclasses.asdict(self.engine.stats()))
        dead = nodes_reap()
        if dead:
            moved = turns_redispatch(from_nodes=dead)
            logger.warning("nodes %s missed their heartbeats: marked down, %d turns sent elsewhere", dead, moved)

    def _run(self) -> None:
        while not self._stop.wait(settings.ROUTER_HEARTBEAT_SECONDS):
            try:
                self.beat()
            except Exception:  # a database hiccup must not stop the heartbeat
                logger.exception("heartbeat of node %s failed", self.name)
            finally:
                close_old_connections()
