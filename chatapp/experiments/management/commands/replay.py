import json
import sys
import threading
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from chatapp.experiments import report
from chatapp.experiments.models import Experiment, Run
from chatapp.experiments.replay import parse_strategies, replay_dry, replay_live, replay_user
from chatapp.experiments.sources import SourceError, chitchat_sessions, jsonl_sessions
from router.services import healthy_nodes


class Command(BaseCommand):
    help = (
        "Replay recorded conversations through the real services and nodes (or, with --dry-run, through memory "
        "assembly only) under each strategy, store every turn's cost, and print a comparison table."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--strategies",
            default="full,window,stable_prefix",
            help="Comma-separated aliases, each with optional overrides: token_budget:history_tokens=512.",
        )
        parser.add_argument(
            "--policy", default="", help="Routing policy alias (ROUTER_POLICIES); default: the router's."
        )
        parser.add_argument("--source", choices=["chitchat", "jsonl", "probes"], default="chitchat")
        parser.add_argument(
            "--file", type=Path, help="The JSONL file for --source jsonl or probes (make_probes writes one)."
        )
        parser.add_argument("--sessions", type=int, default=8, help="Sessions to replay (the first N of a file).")
        parser.add_argument("--turns", type=int, default=6, help="User turns per session (probes keep all theirs).")
        parser.add_argument("--concurrency", type=int, default=4, help="Sessions in flight at once (live runs).")
        parser.add_argument("--max-tokens", type=int, default=48, help="Longest reply, in tokens.")
        parser.add_argument(
            "--model", default="", help="The model that answers (live runs; default: CHAT_DEFAULT_MODEL)."
        )
        parser.add_argument("--seed", type=int, default=0, help="Chooses the dataset's sessions; seeds sampling.")
        parser.add_argument("--name", default="", help="The experiment's name (default: describes the options).")
        parser.add_argument(
            "--out", type=Path, help="Folder for turns.csv, report.json and charts (default var/experiments/<id>)."
        )
        parser.add_argument("--json", action="store_true", help="Print the report as JSON instead of a table.")
        parser.add_argument("--dry-run", action="store_true", help="Assembly costs only: no model, no node, seconds.")

    def handle(self, *args, **options):
        try:
            specs = parse_strategies(options["strategies"])
            sessions = self._sessions(options)
        except (ValueError, SourceError) as exc:
            raise CommandError(str(exc)) from exc
        if options["policy"] and options["policy"] not in settings.ROUTER_POLICIES:
            raise CommandError(
                f"Unknown policy {options['policy']!r}; choose one of: {', '.join(settings.ROUTER_POLICIES)}."
            )
        if not options["dry_run"] and not healthy_nodes():
            raise CommandError("No inference node is up: start one (`python manage.py run_node`, or `make run`).")
        model = options["model"] or settings.CHAT_DEFAULT_MODEL
        if not options["dry_run"] and not healthy_nodes(model=model):
            raise CommandError(f"No inference node serves {model}: start one (`run_node --model {model}`).")
        params = {k: options[k] for k in ("sessions", "turns", "concurrency", "max_tokens", "seed", "policy")}
        params["model"] = model
        experiment = Experiment.objects.create(
            name=options["name"] or f"{options['source']} x{len(sessions)}: {options['strategies']}",
            source=options["source"],
            source_path=str(options["file"] or ""),
            dry_run=options["dry_run"],
            params=params,
        )
        total = len(specs) * sum(len(s.user_messages) for s in sessions)
        progress = _ProgressBar(total, quiet=options["json"] or options["verbosity"] == 0)
        for spec in specs:
            run = Run.objects.create(
                experiment=experiment,
                label=spec.label,
                strategy=spec.strategy,
                strategy_options=spec.options,
                policy=options["policy"],
            )
            progress.label = spec.label
            if options["dry_run"]:
                replay_dry(run, sessions, max_tokens=options["max_tokens"], progress=progress.tick)
            else:
                replay_live(
                    run,
                    sessions,
                    owner=replay_user(),
                    concurrency=options["concurrency"],
                    max_tokens=options["max_tokens"],
                    seed=options["seed"],
                    model=model,
                    progress=progress.tick,
                )
            run.summary = report.run_summary(run)
            run.save(update_fields=["summary"])
        progress.close()
        out_dir = options["out"] or Path(settings.BASE_DIR) / "var" / "experiments" / str(experiment.pk)
        written = report.write_outputs(experiment, out_dir)
        result = report.experiment_report(experiment)
        if options["json"]:
            self.stdout.write(json.dumps(result, default=str))
            return
        self.stdout.write(f"Experiment {experiment.pk}: {experiment.name}")
        self.stdout.write(report.table(result))
        self.stdout.write(f"Wrote {', '.join(p.name for p in written)} to {out_dir}")

    @staticmethod
    def _sessions(options):
        if options["source"] == "chitchat":
            return chitchat_sessions(count=options["sessions"], turns=options["turns"], seed=options["seed"])
        if not options["file"]:
            raise ValueError(f"--source {options['source']} needs --file PATH.")
        return jsonl_sessions(options["file"], count=options["sessions"], turns=options["turns"])


class _ProgressBar:
    """`[#####.....] 12/48 turns  full` on stderr, redrawn in place."""

    def __init__(self, total: int, *, quiet: bool) -> None:
        self.total, self.done, self.quiet, self.label = total, 0, quiet, ""
        self._lock = threading.Lock()
        self._drawn = 0.0

    def tick(self) -> None:
        with self._lock:
            self.done += 1
            now = time.monotonic()
            if self.quiet or (now - self._drawn < 0.2 and self.done < self.total):
                return
            self._drawn = now
            filled = 30 * self.done // max(self.total, 1)
            bar = f"[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} turns  {self.label[:40]:<40}"
            sys.stderr.write("\r" + bar)
            sys.stderr.flush()

    def close(self) -> None:
        if not self.quiet:
            sys.stderr.write("\n")
