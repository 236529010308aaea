import json

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from router import benchmark

TARGETS = {"p99_assign_ms": "<= 5", "affinity": ">= 0.99", "max_mean_load": "<= 1.5"}


class Command(BaseCommand):
    help = "Measure routing on real Postgres (in a throwaway database) and print a table per policy."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
        parser.add_argument("--nodes", type=int, default=8, help="Registered nodes.")
        parser.add_argument("--sessions", type=int, default=10_000, help="Sessions already assigned.")
        parser.add_argument("--decisions", type=int, default=2000, help="Timed assignment decisions.")
        parser.add_argument("--replay-sessions", type=int, default=1000, help="Sessions in the skewed replay.")
        parser.add_argument("--replay-turns", type=int, default=5000, help="Turns in the skewed replay.")
        parser.add_argument("--seed", type=int, default=1, help="Random seed.")

    def handle(self, *args, **options):
        if options["nodes"] < 1 or options["sessions"] < 1:
            raise CommandError("--nodes and --sessions must be at least 1.")
        old_name = connection.settings_dict["NAME"]
        connection.settings_dict["TEST"]["NAME"] = f"{old_name}_bench_router"  # never the test suite's database
        connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
        try:
            results = self._measure(options)
        finally:
            connection.creation.destroy_test_db(old_name, verbosity=0)
        if options["json"]:
            self.stdout.write(json.dumps(results))
            return
        self.stdout.write(f"{'policy':14} {'metric':18} {'value':>10}  target")
        for policy, metrics in results.items():
            for key, value in metrics.items():
                target = TARGETS.get(key, "") if policy == settings.ROUTER_DEFAULT_POLICY else ""
                self.stdout.write(f"{policy:14} {key:18} {value:10.3f}  {target}")

    def _measure(self, options) -> dict[str, dict[str, float]]:
        names = benchmark.register_nodes(options["nodes"])
        with benchmark.heartbeating(names):
            return self._measure_with(names, options)

    def _measure_with(self, names: list[str], options) -> dict[str, dict[str, float]]:
        benchmark.preassign(options["sessions"], names)
        default = settings.ROUTER_DEFAULT_POLICY
        results = {default: benchmark.assign_latency(options["sessions"], options["decisions"], options["seed"])}
        for policy in settings.ROUTER_POLICIES:
            benchmark.clear_assignments()
            replay = benchmark.skewed_replay(
                policy, options["replay_sessions"], options["replay_turns"], options["seed"]
            )
            results.setdefault(policy, {}).update(replay)
        return results
