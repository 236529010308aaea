import json
import random
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from chatapp.experiments import cluster
from chatapp.experiments.models import Experiment
from chatapp.experiments.simulator import NodeProfile


class Command(BaseCommand):
    help = (
        "Simulate a cluster of nodes (discrete events, calibrated on this machine's engine) under each routing "
        "policy from 1 to 1,000 nodes, or, with --validate, check the simulation against a live replay."
    )

    def add_arguments(self, parser):
        parser.add_argument("--calibration", type=Path, default=Path(settings.BASE_DIR) / "var" / "calibration.json")
        parser.add_argument("--calibrate", action="store_true", help="Measure the node now (loads the model, ~1 min).")
        parser.add_argument(
            "--colocated",
            type=int,
            default=1,
            help="Nodes sharing this machine while calibrating (2: the validation's).",
        )
        parser.add_argument(
            "--dispatch-concurrency", type=int, default=1, help="Conversations at once while measuring dispatch time."
        )
        parser.add_argument("--nodes", default="1,10,100,1000", help="Cluster sizes to sweep.")
        parser.add_argument("--sessions-per-node", type=int, default=1000)
        parser.add_argument("--max-sessions", type=int, default=1_000_000)
        parser.add_argument("--rate", type=float, default=0.05, help="New sessions a second, per node.")
        parser.add_argument("--policies", default=",".join(settings.ROUTER_POLICIES))
        parser.add_argument(
            "--baseline-max-nodes", type=int, default=1000, help="Largest cluster for the cache-blind baselines."
        )
        parser.add_argument(
            "--skew",
            type=float,
            default=0.0,
            help="Skewed activity: a Pareto shape (e.g. 1.2); 0: every session alike.",
        )
        parser.add_argument("--strategy", default=settings.CHAT_DEFAULT_STRATEGY, help="Shapes the turns' prompts.")
        parser.add_argument("--turns", type=int, default=4, help="Turns per session (at most).")
        parser.add_argument("--max-tokens", type=int, default=48, help="Longest reply, in tokens.")
        parser.add_argument("--pool", type=int, default=200, help="Dataset conversations profiled into turn shapes.")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--validate", type=int, metavar="EXPERIMENT", help="Compare with this live replay.")
        parser.add_argument("--json", action="store_true")

    def handle(self, *args, **options):
        if options["skew"] < 0:
            raise CommandError("--skew must be 0 (off) or a positive Pareto shape.")
        profile = self._profile(options)
        if options["validate"]:
            experiment = Experiment.objects.filter(pk=options["validate"], dry_run=False).first()
            if experiment is None:
                raise CommandError(f"No live replay experiment {options['validate']}.")
            rows = cluster.validate(experiment, profile)
            self._print(rows, options, title=f"Simulation against live replay {experiment.pk} ({experiment.name})")
            return
        started = time.perf_counter()
        profiles = cluster.turn_profiles(
            strategy=options["strategy"],
            count=options["pool"],
            turns=options["turns"],
            max_tokens=options["max_tokens"],
            rng=random.Random(options["seed"]),  # noqa: S311
        )
        rows = []
        for nodes in [int(n) for n in options["nodes"].split(",")]:
            sessions = min(nodes * options["sessions_per_node"], options["max_sessions"])
            for policy in options["policies"].split(","):
                if not policy.startswith("sticky") and nodes > options["baseline_max_nodes"]:
                    continue
                rows.append(
                    cluster.sweep_point(
                        profile,
                        profiles,
                        policy=policy,
                        nodes=nodes,
                        sessions=sessions,
                        rate=options["rate"],
                        seed=options["seed"],
                        skew=options["skew"],
                    )
                )
                if not options["json"]:
                    self.stderr.write(f"... {policy} on {nodes} nodes: {rows[-1]['wall_s']:.1f} s")
        self._print(rows, options, title=f"Cluster simulation ({time.perf_counter() - started:.0f} s in all)")

    def _profile(self, options) -> NodeProfile:
        path: Path = options["calibration"]
        if options["calibrate"] or not path.exists():
            if not options["json"]:
                self.stderr.write(f"Measuring this node for {path} ...")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(
                json.dumps(
                    cluster.measure_node(colocated=options["colocated"], concurrency=options["dispatch_concurrency"]),
                    indent=2,
                )
            )
        figures = json.loads(path.read_text())
        return NodeProfile(**{k: figures[k] for k in NodeProfile.__dataclass_fields__ if k in figures})

    def _print(self, rows: list[dict], options, *, title: str) -> None:
        if options["json"]:
            self.stdout.write(json.dumps(rows, default=str))
            return
        self.stdout.write(title)
        self.stdout.write(cluster.format_table(rows))
