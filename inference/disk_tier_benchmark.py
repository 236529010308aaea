"""The disk tier in `bench_node`: restoring a session from disk against recomputing it, after a restart and
after a move to another node, what a write costs, and what writing costs the decoding beside it.

Every figure comes from interleaved pairs (`inference.benchmark.alternating`), on engines in this process
that share a temporary directory as nodes on one machine share `KV_DISK_PATH`.
"""

import statistics
import tempfile
import time

from inference.batch_engine import BatchEngine
from inference.benchmark import BenchSettings, NodeBenchmark, alternating, greedy, long_conversation, paired
from inference.chat_templates import ChatMessage
from inference.config import EngineConfig


class DiskTierBenchmark:
    def __init__(self, config: EngineConfig, conversations: list[list[str]], settings: BenchSettings) -> None:
        self.conversations = conversations
        self.settings = settings
        # Write-behind off: files are written where each figure needs them (a shutdown, a drain, a spill).
        self.config = config.replace(KV_DISK_IDLE_S=0, MAX_RESIDENT_SESSIONS=4, MAX_CONCURRENT=16)

    def run(self) -> dict:
        with tempfile.TemporaryDirectory(prefix="bench-kv-") as root:
            self.settings.progress("disk tier: restore after a restart and after a move, vs recompute")
            results = self.restart_and_move(root)
            self.settings.progress("disk tier: a spilling replay with the disk tier and without")
            results |= self.spilling_replay(root)
        return results

    def _engine(self, root: str, node: str, **settings) -> BatchEngine:
        return BatchEngine(self.config.replace(KV_DISK_PATH=root, NODE_NAME=node, **settings))

    def restart_and_move(self, root: str) -> dict:
        s = self.settings
        restart: dict[str, list[float]] = {"restore": [], "recompute": []}
        move: dict[str, list[float]] = {"restore": [], "recompute": []}
        tokens: list[int] = []
        node = self._engine(root, "bench-a")
        neighbour = self._engine(root, "bench-b")
        try:
            for i in range(s.repeats):
                fmt = node.chat_format
                *earlier, question = long_conversation(fmt, self.conversations[i * 20 + 7 :], s.long_tokens)
                key = f"disk-{i}"
                reply = node.generate(session_key=key, prompt=fmt.render(earlier[:-1]), sampling=greedy(s.reply_tokens))
                answered = [*earlier[:-1], ChatMessage("assistant", reply.text, tuple(reply.token_ids))]
                prompt = fmt.render([*answered, question])
                tokens.append(len(prompt))

                node.close()  # a clean shutdown writes the session; the node comes back under its name
                node = self._engine(root, "bench-a")
                _measure_pair(restart, node, key, prompt, i, source="disk")
                _drain(node)  # the router drained it: the session's state is on disk for the neighbour
                _measure_pair(move, neighbour, key, prompt, i, source="other_node")
            writes = list(node.disk.writes) if node.disk is not None else []
        finally:
            node.close()
            neighbour.close()
        return {
            "disk_conversation_tokens": statistics.median(tokens),
            "restart_restore_ms": statistics.median(restart["restore"]),
            "restart_recompute_ms": statistics.median(restart["recompute"]),
            **paired("restart_restore_vs_recompute", _ratios(restart)),
            "move_restore_ms": statistics.median(move["restore"]),
            "move_recompute_ms": statistics.median(move["recompute"]),
            **paired("move_restore_vs_recompute", _ratios(move)),
            "disk_write_ms_per_session": statistics.median(w.ms for w in writes),
            "disk_write_mb_per_session": statistics.median(w.bytes for w in writes) / 2**20,
        }

    def spilling_replay(self, root: str) -> dict:
        """More sessions than resident slots, so turns spill sessions all along: decode throughput with the
        disk tier writing every spill, against the same replay without a disk tier. Each run has an engine
        of its own, so that neither kind always runs on the engine made first."""
        s = self.settings
        long_enough = [c for c in self.conversations if len(c) >= 2 * s.replay_turns]
        sessions = long_enough[: 2 * self.config.MAX_RESIDENT_SESSIONS]
        rates: dict[str, list[float]] = {"disk": [], "ram": []}
        written = 0
        for r in range(s.repeats):
            for kind in alternating("disk", "ram", r):
                engine = self._engine(root if kind == "disk" else "", "bench-spill")
                try:
                    wall, generated = NodeBenchmark(engine, self.conversations, s)._replay_here(sessions, f"spill-{r}")
                    rates[kind].append(generated / wall)
                    written += len(engine.disk.writes) if engine.disk is not None else 0
                finally:
                    engine.close()
        slowdowns = [1 - d / m for d, m in zip(rates["disk"], rates["ram"], strict=True)]
        return {
            "spill_replay_tokens_per_s_disk": statistics.median(rates["disk"]),
            "spill_replay_tokens_per_s_ram": statistics.median(rates["ram"]),
            **paired("disk_tier_decode_slowdown", slowdowns),
            "spill_replay_disk_writes": written / s.repeats,
        }


def _drain(engine: BatchEngine) -> None:
    """Draining: the engine writes its idle sessions at once; wait until they are on disk."""
    assert engine.disk is not None
    before = len(engine.disk.writes)
    engine.set_draining(True)
    deadline = time.monotonic() + 30
    while len(engine.disk.writes) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    engine.disk.flush()
    engine.set_draining(False)


def _measure_pair(
    times: dict[str, list[float]], engine: BatchEngine, key: str, prompt: list[int], repeat: int, *, source: str
) -> None:
    """The prompt's first turn on `engine`, restored (session `key`, from `source`) and recomputed (a new
    session), in alternating order. Each time goes into `times`: from the call to its first (and only)
    token, so reading the file, wherever it happens, counts."""
    for kind in alternating("restore", "recompute", repeat):
        session = key if kind == "restore" else f"{key}-recompute-{engine.config.NODE_NAME}"
        started = time.perf_counter()
        generation = engine.generate(
            session_key=session, prompt=prompt, sampling=greedy(1, cache_prompt=kind == "restore")
        )
        elapsed_ms = (time.perf_counter() - started) * 1000
        expected = source if kind == "restore" else "none"
        if generation.cache_source != expected:
            raise RuntimeError(f"the {kind} turn reused tokens from {generation.cache_source!r}, not {expected!r}")
        times[kind].append(elapsed_ms)


def _ratios(pairs: dict[str, list[float]]) -> list[float]:
    return [r / c for r, c in zip(pairs["restore"], pairs["recompute"], strict=True)]
