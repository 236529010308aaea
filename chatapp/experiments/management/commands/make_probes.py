from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from chatapp.experiments.probes import make_probes, write_probes


class Command(BaseCommand):
    help = (
        "Write a planted-fact probe set (JSONL): a fact in the first message, real conversation from the "
        "chitchat dataset in between, then a question whose answer is the fact. Replay it with "
        "`replay --source probes --file PATH`."
    )

    def add_arguments(self, parser):
        parser.add_argument("--out", type=Path, default=Path("var/probes.jsonl"))
        parser.add_argument("--distances", default="1,4,8,16", help="Exchanges between fact and question.")
        parser.add_argument("--per-distance", type=int, default=5, help="Probes at each distance.")
        parser.add_argument("--seed", type=int, default=0)

    def handle(self, *args, **options):
        try:
            distances = [int(d) for d in options["distances"].split(",") if d.strip()]
        except ValueError as exc:
            raise CommandError(f"--distances takes whole numbers, as in 1,4,8: {exc}") from exc
        if not distances or min(distances) < 0 or options["per_distance"] < 1:
            raise CommandError("Give at least one distance (0 or more) and --per-distance of at least 1.")
        records = make_probes(distances=distances, per_distance=options["per_distance"], seed=options["seed"])
        write_probes(options["out"], records)
        self.stdout.write(f"Wrote {len(records)} probes ({len(distances)} distances) to {options['out']}")
