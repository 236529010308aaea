import json
import time
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from chatapp.experiments import memory_bench as bench
from chatapp.experiments.locomo import CATEGORIES, DEFAULT_FILE, locomo_read
from chatapp.experiments.memory_charts import CHARTS
from chatapp.experiments.replay import parse_strategies, replay_user
from chatapp.experiments.report import cell, text_table
from chatapp.experiments.sources import SourceError
from inference.config import EngineConfig
from inference.tokenizer import chat_format_for

DEFAULT_STRATEGIES = "full,window,token_budget,stable_prefix,summary,retrieval,recall,recall_cached"


class Command(BaseCommand):
    help = (
        "Measure memory quality on LoCoMo without a model: the share of each question's evidence turns that "
        "every strategy keeps in its prompt, at each budget, with what each question computes."
    )

    def add_arguments(self, parser):
        parser.add_argument("--file", type=Path, default=DEFAULT_FILE, help="A LoCoMo JSON file.")
        parser.add_argument(
            "--strategies",
            default=DEFAULT_STRATEGIES,
            help="Comma-separated aliases, each with optional overrides: recall:recall_tokens=1024.",
        )
        parser.add_argument(
            "--budgets", default="2048,3072,4096", help="Prompt token limits (the reply's budget excluded)."
        )
        parser.add_argument("--conversations", type=int, help="Only the first N conversations of the file.")
        parser.add_argument(
            "--answer",
            type=int,
            default=0,
            metavar="N",
            help="Also have the model answer N sampled questions (categories 1-4) under each strategy, at the "
            "first budget, scored with LoCoMo's F1.",
        )
        parser.add_argument("--answer-tokens", type=int, default=32, help="Longest answer, in tokens.")
        parser.add_argument("--seed", type=int, default=0, help="Chooses the answered questions.")
        parser.add_argument(
            "--out", type=Path, default=settings.BASE_DIR / "var" / "bench_memory", help="Folder for the report."
        )
        parser.add_argument("--json", action="store_true", help="Print the report as JSON instead of a table.")

    def handle(self, *args, **options):
        try:
            specs = parse_strategies(options["strategies"])
            budgets = [int(b) for b in options["budgets"].split(",") if b.strip()]
            conversations = locomo_read(options["file"])[: options["conversations"]]
        except (ValueError, SourceError) as exc:
            raise CommandError(str(exc)) from exc
        if not conversations:
            raise CommandError(f"{options['file']}: no conversation to measure (see --conversations).")
        if not budgets or min(budgets) < 64:
            raise CommandError("Give at least one budget of 64 tokens or more, as in --budgets 2048,3072.")
        config = EngineConfig()
        fmt = chat_format_for(config.model_file())
        if options["answer"] and budgets[0] + options["answer_tokens"] + fmt.overhead > config.N_CTX:
            raise CommandError(f"--answer needs the first budget plus the answer to fit N_CTX={config.N_CTX}.")
        owner = replay_user()
        stored = [bench.locomo_store(c, owner=owner) for c in conversations]
        sample = bench.answer_sample(stored, options["answer"], seed=options["seed"]) if options["answer"] else {}
        runs, answers = [], []
        engine = None
        started = time.perf_counter()
        try:
            for spec in specs:
                for budget in budgets:
                    results = {}
                    for s in stored:
                        keep = sample.get(s.source.sample_id, set()) if budget == budgets[0] else set()
                        results[s.source.sample_id] = bench.run_questions(
                            s, spec, budget=budget, fmt=fmt, keep_prompts=keep
                        )
                    run = bench.run_summary(spec.label, budget, [r for rs in results.values() for r in rs])
                    if sample and budget == budgets[0]:
                        if engine is None:
                            engine = _engine(config)
                        replies = [
                            a
                            for s in stored
                            for a in bench.answer_questions(
                                engine,
                                spec.label,
                                s,
                                results[s.source.sample_id],
                                max_tokens=options["answer_tokens"],
                            )
                        ]
                        answers += [{"strategy": spec.label, **a} for a in replies]
                        run["answer_f1"] = bench.mean_or_none([a["f1"] for a in replies])
                        run["answered"] = len(replies)
                    runs.append(run)
                    if not options["json"]:
                        self.stderr.write(f"... {spec.label} @ {budget}: recall {run['recall']}")
        finally:
            if engine is not None:
                engine.close()
        report = bench.bench_report(runs, budgets)
        report["bench_wall_s"] = round(time.perf_counter() - started, 1)
        report["file"] = str(options["file"])
        written = self._write(options["out"], report, answers)
        if options["json"]:
            self.stdout.write(json.dumps(report))
            return
        self.stdout.write(table(report))
        self.stdout.write(f"\nWritten: {', '.join(str(p) for p in written)}")

    @staticmethod
    def _write(out: Path, report: dict, answers: list[dict]) -> list[Path]:
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "report.json"]
        paths[0].write_text(json.dumps(report, indent=2))
        if answers:
            paths.append(out / "answers.json")
            paths[-1].write_text(json.dumps(answers, indent=2))
        for name, draw in CHARTS.items():
            paths.append(out / name)
            paths[-1].write_bytes(draw(report))
        return paths


def _engine(config: EngineConfig):
    from inference.batch_engine import BatchEngine

    return BatchEngine(config)


def table(report: dict) -> str:
    """The runs as a table, then the best strategy at each budget and the published reference."""
    categories = list(CATEGORIES.values())
    header = ["strategy", "budget", "recall", *categories, "prompt", "computed", "share", "asm p95 ms", "failed"]
    answered = any("answer_f1" in r for r in report["runs"])
    rows = []
    for r in report["runs"]:
        row = [r["strategy"], str(r["budget"]), cell(r["recall"], "{:.3f}")]
        row += [cell(r["recall_by_category"].get(c), "{:.3f}") for c in categories]
        row += [cell(r["prompt_tokens_median"], "{:.0f}"), cell(r["computed_tokens_median"], "{:.0f}")]
        row += [cell(r["computed_share"], "{:.3f}"), cell(r["assembly_p95_ms"], "{:.1f}"), str(r["failed"])]
        rows.append([*row, cell(r.get("answer_f1"), "{:.3f}")] if answered else row)
    lines = [text_table([*header, "answer F1"] if answered else header, rows, left=1)]
    for budget in sorted({r["budget"] for r in report["runs"]}):
        if f"best_strategy_{budget}" in report:
            recall, share = report[f"best_recall_{budget}"], report[f"computed_share_{budget}"]
            lines.append(
                f"best at {budget}: {report[f'best_strategy_{budget}']} "
                f"(recall {cell(recall, '{:.3f}')}, computed share {cell(share, '{:.3f}')})"
            )
    lines.append("DRAGON (LoCoMo paper), recall at top-k: " + ", ".join(f"{k} {v}" for k, v in bench.DRAGON.items()))
    return "\n".join(lines)
