import time

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from chatapp.celery import app
from chatapp.health import require_services
from chatapp.node_heartbeat import Heartbeat
from chatapp.node_identity import incarnation
from chatapp.turns.recovery import turns_hand_off, turns_take_back
from inference.chat_templates import UnsupportedTemplate
from inference.config import BadEngineSetting, engine_config
from inference.engine import get_engine
from inference.model_files import DEFAULT_MODEL, PACKAGED, ModelNotFound
from router.services import ServedModel, node_start, node_stop, queue_for_node


class Command(BaseCommand):
    help = "Start an inference node: load the model once, register with the router, serve the node's own queue."

    def add_arguments(self, parser):
        parser.add_argument("--name", default=settings.NODE_NAME, help="Node name; it consumes queue node.<name>.")
        parser.add_argument(
            "--concurrency",
            type=int,
            default=None,
            help="Worker threads; each waits on one generation (default: MAX_CONCURRENT).",
        )
        parser.add_argument(
            "--model",
            default=None,
            help=f"A packaged model ({', '.join(PACKAGED)}; default {DEFAULT_MODEL}), or the name MODEL_PATH's "
            "file is served under (default: MODEL).",
        )
        parser.add_argument("--loglevel", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])

    def handle(self, *, name: str, concurrency: int | None, model: str | None, loglevel: str, **options):
        try:
            config = engine_config(NODE_NAME=name, **({"MODEL": model} if model is not None else {}))
        except BadEngineSetting as exc:
            raise CommandError(f"node {name}: {exc}") from None
        concurrency = concurrency or config.MAX_CONCURRENT
        require_services()
        started = time.perf_counter()
        try:
            engine = get_engine(config)
        except (ModelNotFound, UnsupportedTemplate) as exc:
            raise CommandError(f"node {name}: {exc}") from exc
        served = ServedModel(
            model=engine.model,
            model_path=str(config.model_file().path),
            chat_template=engine.chat_format.template,
            n_ctx=engine.n_ctx,
            max_reply_tokens=config.MAX_REPLY_TOKENS,
            kv_store=engine.kv_store,
        )
        self.stdout.write(
            f"node {name}: {engine.name} engine loaded {engine.model} ({served.chat_template} template, "
            f"{engine.n_ctx}-token context) in {time.perf_counter() - started:.1f}s"
        )
        node_start(name=name, capacity=concurrency, incarnation=incarnation(), served=served)
        if taken := turns_take_back(node=name):
            self.stdout.write(f"node {name}: took back {taken} turns an earlier process left unfinished")
        heartbeat = Heartbeat(name=name, incarnation=incarnation(), capacity=concurrency, engine=engine, served=served)
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
                    "--without-heartbeat",  # Celery's worker events: no one reads them (the router has its own)
                ]
            )
        finally:  # a clean shutdown: running turns are done; queued ones go elsewhere, or fail clearly
            heartbeat.stop()
            if node_stop(name=name, incarnation=incarnation()) and (handed := turns_hand_off(node=name)):
                self.stdout.write(f"node {name}: handed off {handed} queued turns")
            engine.close()  # writes its resident sessions to the disk tier, for whoever serves them next
