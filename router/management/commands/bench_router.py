import json

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from router import benchmark

TARGETS = {
    "p99_assign_ms": "<= 1 at 1,000 nodes",
    "p99_placement_ms": "<= 1 at 1,000 nodes",
    "affinity": ">= 0.98",
    "max_mean_load": "<= 1.5",
    "max_mean_turns": "<= 1.3",
    "warm_moves_per_turn": "<= 0.01",
}


class Command(BaseCommand):
    help = (
        "Measure routing on real Postgres (in a throwaway database): decision latency at two cluster sizes, "
        "and a Zipf-skewed replay per policy."
    )

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
        parser.add_argument("--nodes", type=int, default=8, help="Registered nodes (latency and the replay).")
        parser.add_argument("--scale-nodes", type=int, default=1000, help="Latency again at this many (0: skip).")
        parser.add_argument("--sessions", type=int, default=10_000, help="Sessions already assigned.")
        parser.add_argument(
            "--decisions", type=int, default=5000, help="Timed assignment decisions a run (one in ten a first turn)."
        )
        parser.add_argument("--replay-sessions", type=int, default=1000, help="Sessions in the skewed replay.")
        parser.add_argument("--replay-turns", type=int, default=5000, help="Turns in the skewed replay.")
        parser.add_argument("--policies", default=",".join(settings.ROUTER_POLICIES), help="Replayed policies.")
        parser.add_argument(
            "--repeats", type=int, default=3, help="Latency runs, and replays per policy, each with its own draw."
        )
        parser.add_argument(
            "--break-every",
            type=int,
            default=25,
            help="A session's prompt breaks its prefix every this many of its turns (stable_prefix on chitchat).",
        )
        parser.add_argument("--seed", type=int, default=1, help="Random seed.")

    def handle(self, *args, **options):
        if min(options["nodes"], options["sessions"], options["repeats"], options["break_every"]) < 1:
            raise CommandError("--nodes, --sessions, --repeats and --break-every must be at least 1.")
        if options["scale_nodes"] < 0:
            raise CommandError("--scale-nodes must be at least 0.")
        policies = [p for p in options["policies"].split(",") if p]
        unknown = [p for p in policies if p not in settings.ROUTER_POLICIES]
        if unknown:
            raise CommandError(f"Unknown policies {unknown}; choose from: {', '.join(settings.ROUTER_POLICIES)}.")
        old_name = connection.settings_dict["NAME"]
        connection.settings_dict["TEST"]["NAME"] = f"{old_name}_bench_router"  # never the test suite's database
        connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
        try:
            results = self._measure(options, policies)
        finally:
            connection.creation.destroy_test_db(old_name, verbosity=0)
        if options["json"]:
            self.stdout.write(json.dumps(results))
            return
        self.stdout.write(f"{'run':22} {'metric':20} {'median':>8}  {'range':17}  target")
        for run, metrics in results.items():
            for key, value in metrics.items():
                if key.endswith("_range"):
                    continue
                spread = metrics.get(f"{key}_range")
                spread_text = f"{spread[0]:.3f} - {spread[1]:.3f}" if spread else ""
                default = run == settings.ROUTER_DEFAULT_POLICY or run.startswith("latency")
                target = TARGETS.get(key, "") if default else ""
                self.stdout.write(f"{run:22} {key:20} {value:8.3f}  {spread_text:17}  {target}")

    def _measure(self, options, policies: list[str]) -> dict[str, dict]:
        results: dict[str, dict] = {}
        for count in dict.fromkeys(n for n in (options["nodes"], options["scale_nodes"]) if n):
            names = benchmark.register_nodes(count)
            with benchmark.heartbeating():
                benchmark.preassign(options["sessions"], names)
                latency = [
                    benchmark.assign_latency(options["sessions"], options["decisions"], options["seed"] + r, names)
                    for r in range(options["repeats"])
                ]
            results[f"latency at {count} nodes"] = benchmark.median_and_range(latency)
            benchmark.remove_nodes()
        names = benchmark.register_nodes(options["nodes"])  # the replay's nodes heartbeat in replay time
        runs: dict[str, list[dict]] = {policy: [] for policy in policies}
        for repeat in range(options["repeats"]):  # interleaved: every policy once, then again
            for policy in policies:
                benchmark.clear_assignments()
                shape = benchmark.ReplayShape(break_every=options["break_every"])
                runs[policy].append(
                    benchmark.skewed_replay(
                        policy,
                        names,
                        options["replay_sessions"],
                        options["replay_turns"],
                        options["seed"] + repeat,
                        shape,
                    )
                )
        return results | {policy: benchmark.median_and_range(figures) for policy, figures in runs.items()}
