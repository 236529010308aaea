import json
import tempfile
import time

from django.core.management.base import BaseCommand

from chatapp.datasets import chitchat_conversations
from inference.batch_engine import BatchEngine
from inference.benchmark import BenchSettings, NodeBenchmark, rounded
from inference.config import EngineConfig
from inference.disk_tier_benchmark import DiskTierBenchmark

TARGETS = {
    "warm_cold_ttft_ratio": ">= 15",
    "warm_extra_prefill_tokens": "0",
    "restore_vs_recompute": "<= 0.1",
    "batch16_decode_speedup": ">= 2.5",
    "replay_speedup_vs_llama_cpp_python": ">= 4",
    "restart_restore_vs_recompute": "<= 0.1",
    "move_restore_vs_recompute": "<= 0.2",
    "disk_tier_decode_slowdown": "<= 0.05",
}


class Command(BaseCommand):
    help = "Measure the inference node on this machine (one process, real model, real conversations) and print a table."

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", help="Print one JSON object instead of a table.")
        parser.add_argument("--long-tokens", type=int, default=1500, help="Conversation length for warm/cold turns.")
        parser.add_argument(
            "--repeats", type=int, default=3, help="Interleaved pairs behind each ratio (its median and range)."
        )
        parser.add_argument("--batch", type=int, default=16, help="Concurrent generations for the decode speedup.")
        parser.add_argument("--decode-tokens", type=int, default=128, help="Tokens per generation in that test.")
        parser.add_argument("--sessions", type=int, default=16, help="Sessions in the replay.")
        parser.add_argument("--turns", type=int, default=8, help="Turns per replayed session.")
        parser.add_argument("--reply-tokens", type=int, default=32, help="Longest reply in the replay.")
        parser.add_argument("--no-baseline", action="store_true", help="Skip the llama-cpp-python replay.")

    def handle(self, *args, **options):
        as_json = options["json"]
        settings = BenchSettings(
            long_tokens=options["long_tokens"],
            repeats=options["repeats"],
            batch=options["batch"],
            decode_tokens=options["decode_tokens"],
            replay_sessions=options["sessions"],
            replay_turns=options["turns"],
            reply_tokens=options["reply_tokens"],
            baseline=not options["no_baseline"],
            progress=(lambda m: None) if as_json else (lambda m: self.stderr.write(f"... {m}")),
        )
        config = EngineConfig()
        conversations = list(chitchat_conversations(min_messages=2))
        started = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="bench-node-kv-") as kv_dir:  # not the nodes' own disk tier
            config = config.replace(
                MAX_RESIDENT_SESSIONS=max(config.MAX_RESIDENT_SESSIONS, settings.batch, settings.replay_sessions),
                MAX_CONCURRENT=max(config.MAX_CONCURRENT, settings.batch, settings.replay_sessions),
                KV_DISK_PATH=kv_dir if config.KV_DISK_PATH else "",
            )
            engine = BatchEngine(config)
            try:
                results = NodeBenchmark(engine, conversations, settings).run()
            finally:
                engine.close()
        results |= DiskTierBenchmark(config, conversations, settings).run()
        results["bench_wall_s"] = time.perf_counter() - started
        if as_json:
            self.stdout.write(json.dumps({k: rounded(v) for k, v in results.items()}))
            return
        self.stdout.write(f"{'metric':40} {'median':>12} {'range':>15}  target")
        for key, value in results.items():
            if not key.endswith("_range"):
                low, high = results.get(f"{key}_range", (None, None))
                spread = f"{low:.3f}-{high:.3f}" if low is not None else ""
                self.stdout.write(f"{key:40} {value:12.3f} {spread:>15}  {TARGETS.get(key, '')}")
