import time

from django.conf import settings
from django.core.management.base import BaseCommand

from chatapp.celery import app
from chatapp.health import require_services
from chatapp.node_heartbeat import Heartbeat
from chatapp.node_identity import incarnation
from chatapp.turns.recovery import turns_hand_off, turns_take_back
from inference.config import EngineConfig
from inference.engine import get_engine
from router.services import node_start, node_stop, queue_for_node


class Command(BaseCommand):
    help = "Start an inference node: load the model once, register with the router, serve the node's own queue."

    def add_arguments(self, parser):
        parser.add_argument("--name", default=settings.NODE_NAME, help="Node name; it consumes queue node.<name>.")
        parser.add_argument(
            "--concurrency",
            type=int,
            default=EngineConfig().MAX_CONCURRENT,
            help="Worker threads; each waits on one generation (default: MAX_CONCURRENT).",
        )
        parser.add_argument("--loglevel", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    def handle(self, *, name: str, concurrency: int, loglevel: str, **options):
        require_services()
        started = time.perf_counter()
        engine = get_engine()
        self.stdout.write(f"node {name}: {engine.name} engine loaded in {time.perf_counter() - started:.1f}s")
        node_start(name=name, capacity=concurrency, incarnation=incarnation())
        if taken := turns_take_back(node=name):
            self.stdout.write(f"node {name}: took back {taken} turns an earlier process left unfinished")
        heartbeat = Heartbeat(name=name, incarnation=incarnation(), capacity=concurrency, engine=engine)
        heartbeat.start()
        try:
            app.worker_main(
                argv=[
                    "worker",
                    f"--queues={queue_for_node(name)}",
                    f"--hostname={name}@%h",
                    "--pool=threads",
                    f"--concurrency={concurrency}",
                    f"--loglevel={loglevel}",
                    "--without-gossip",
                    "--without-mingle",
                ]
            )
        finally:  # a clean shutdown: running turns are done; queued ones go elsewhere, or fail clearly
            heartbeat.stop()
            if node_stop(name=name, incarnation=incarnation()) and (handed := turns_hand_off(node=name)):
                self.stdout.write(f"node {name}: handed off {handed} queued turns")
