"""Node benchmarks, each a ratio measured side by side in one process (this machine is noisy).

Every ratio comes from pairs measured one right after the other, in alternating order (A B, B A, ...),
`repeats` times: the figure is the median ratio, with its range (`<name>_range`). Conversations come in as
plain lists of message texts, so this module needs nothing but the engine.
"""

import statistics
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial

from inference.batch_engine import BatchEngine
from inference.chat_format import ChatFormat
from inference.chat_templates import ChatMessage, TemplateSpec
from inference.config import EngineConfig
from inference.types import Generation, Sampling

BASELINE_CACHE_BYTES = 64 * 2**20


@dataclass
class BenchSettings:
    long_tokens: int = 1500  # conversation length for the warm/cold and restore measurements
    repeats: int = 3
    batch: int = 16
    decode_tokens: int = 128
    replay_sessions: int = 16
    replay_turns: int = 8
    reply_tokens: int = 32
    baseline: bool = True  # also replay on llama-cpp-python's own Llama
    progress: Callable[[str], None] = field(default=lambda message: None)


def greedy(max_tokens: int, *, ignore_eos: bool = False, cache_prompt: bool = True) -> Sampling:
    return Sampling(
        max_tokens=max_tokens,
        temperature=0,
        top_p=1,
        repeat_penalty=1.1,
        ignore_eos=ignore_eos,
        cache_prompt=cache_prompt,
    )


def as_chat(texts: Sequence[str]) -> list[ChatMessage]:
    """Alternate user and assistant, starting with the user."""
    return [ChatMessage(role="user" if i % 2 == 0 else "assistant", text=t) for i, t in enumerate(texts)]


def long_conversation(fmt: ChatFormat, conversations: Sequence[list[str]], tokens: int) -> list[ChatMessage]:
    """Real messages, conversation after conversation, until the history passes `tokens`; ends on a user turn."""
    texts: list[str] = []
    for conversation in conversations:
        texts += conversation
        if len(fmt.render(as_chat(texts))) >= tokens:
            break
    if len(texts) % 2 == 0:
        texts.pop()
    return as_chat(texts)


def paired(name: str, ratios: Sequence[float]) -> dict:
    """A ratio's median over its pairs, and its range."""
    return {name: statistics.median(ratios), f"{name}_range": [min(ratios), max(ratios)]}


def rounded(value: float | list[float]) -> float | list[float]:
    """A figure for JSON output: 4 decimals (a range: both ends)."""
    return [round(v, 4) for v in value] if isinstance(value, list) else round(value, 4)


def alternating[T](first: T, second: T, repeat: int) -> tuple[T, T]:
    """The pair in A B order on even repeats, B A on odd ones."""
    return (first, second) if repeat % 2 == 0 else (second, first)


def run_parallel(calls: Sequence[Callable[[], object]]) -> float:
    """Run the calls in threads at once; the wall time in seconds."""
    threads = [threading.Thread(target=call) for call in calls]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


class NodeBenchmark:
    def __init__(self, engine: BatchEngine, conversations: list[list[str]], settings: BenchSettings) -> None:
        self.engine = engine
        self.fmt = engine.chat_format
        self.conversations = conversations
        self.settings = settings

    def run(self) -> dict:
        results: dict = {}
        self.settings.progress("warm vs cold follow-up turns, restore vs recompute")
        results |= self.warm_cold_and_restore()
        self.settings.progress(f"decode throughput, 1 vs {self.settings.batch} concurrent generations")
        results |= self.batch_decode()
        self.settings.progress(f"replay: {self.settings.replay_sessions} sessions x {self.settings.replay_turns} turns")
        results |= self.replay()
        return results

    def _generate(
        self, session: str, prompt: list[int], max_tokens: int, *, ignore_eos: bool = False, cache_prompt: bool = True
    ) -> Generation:
        sampling = greedy(max_tokens, ignore_eos=ignore_eos, cache_prompt=cache_prompt)
        return self.engine.generate(session_key=session, prompt=prompt, sampling=sampling)

    def warm_cold_and_restore(self) -> dict:
        s = self.settings
        warm_ttft, cold_ttft, extra, restore_ms, recompute_ms, prompt_tokens = [], [], [], [], [], []
        for i in range(s.repeats):
            history = long_conversation(self.fmt, self.conversations[i * 20 :], s.long_tokens)
            *earlier, question = history
            turn1 = self.fmt.render(earlier[:-1])  # ends on a user turn; its dataset reply is replaced by the model's
            reply = self._generate(f"warm-{i}", turn1, s.reply_tokens)
            answered = [*earlier[:-1], ChatMessage("assistant", reply.text, tuple(reply.token_ids))]
            turn2 = self.fmt.render([*answered, question])
            measured: dict[str, Generation] = {}
            for kind in alternating("warm", "cold", i):
                measured[kind] = self._generate(f"{kind}-{i}", turn2, 1, cache_prompt=kind == "warm")
            warm_ttft.append(measured["warm"].ttft_ms)
            cold_ttft.append(measured["cold"].ttft_ms)
            extra.append(len(turn1) + len(reply.token_ids) - measured["warm"].cached_tokens)
            prompt_tokens.append(len(turn2))

            # The cold session now holds turn2: spill it, then compare restoring it with recomputing it.
            for filler in range(self.engine.config.MAX_RESIDENT_SESSIONS):
                self._generate(f"filler-{i}-{filler}", self.fmt.render([ChatMessage("user", "Hi")]), 1)
            for kind in alternating("restore", "recompute", i):
                session = f"cold-{i}" if kind == "restore" else f"recompute-{i}"
                measured[kind] = self._generate(session, turn2, 1, cache_prompt=kind == "restore")
            if measured["restore"].cache_source != "ram":
                raise RuntimeError("the spilled session was not restored from RAM")
            restore_ms.append(measured["restore"].prefill_ms)
            recompute_ms.append(measured["recompute"].prefill_ms)
        return {
            "conversation_tokens": statistics.median(prompt_tokens),
            "warm_ttft_ms": statistics.median(warm_ttft),
            "cold_ttft_ms": statistics.median(cold_ttft),
            **paired("warm_cold_ttft_ratio", [c / w for c, w in zip(cold_ttft, warm_ttft, strict=True)]),
            "warm_extra_prefill_tokens": max(extra),
            "restore_ms": statistics.median(restore_ms),
            "recompute_ms": statistics.median(recompute_ms),
            **paired("restore_vs_recompute", [r / c for r, c in zip(restore_ms, recompute_ms, strict=True)]),
        }

    def batch_decode(self) -> dict:
        """Throughput with `batch` generations at once against one alone, in interleaved pairs. Two ratios:
        decoding alone (`batch` x the median generation's tokens a second after its first token, the step
        time as the batch decodes: llama.cpp's `llama-batched-bench` reports it as S_TG), and all tokens over
        the wall time, the prompts' prefill included."""
        s = self.settings
        prompts = [self.fmt.render([ChatMessage("user", c[0])]) for c in self.conversations[: s.batch]]

        def throughput(n: int, tag: str) -> tuple[float, float]:
            results: list[Generation] = []

            def one(k: int) -> None:
                # Every generation decodes all its tokens: a chat model that ends its turn early would
                # otherwise leave the batch part empty.
                results.append(self._generate(f"{tag}-{k}", prompts[k], s.decode_tokens, ignore_eos=True))

            wall = run_parallel([partial(one, k) for k in range(n)])
            decoding = n * statistics.median(r.decode_tokens_per_s for r in results)
            return decoding, sum(len(r.token_ids) for r in results) / wall

        single: list[tuple[float, float]] = []
        batched: list[tuple[float, float]] = []
        for r in range(s.repeats):
            for n in alternating(1, s.batch, r):
                (single if n == 1 else batched).append(throughput(n, f"decode-{n}-{r}"))
        return {
            "decode_tokens_per_s_1": statistics.median(d for d, _ in single),
            f"decode_tokens_per_s_{s.batch}": statistics.median(d for d, _ in batched),
            **paired(f"batch{s.batch}_decode_speedup", [b[0] / a[0] for a, b in zip(single, batched, strict=True)]),
            **paired(f"batch{s.batch}_throughput_speedup", [b[1] / a[1] for a, b in zip(single, batched, strict=True)]),
        }

    def replay(self) -> dict:
        s = self.settings
        sessions = [c for c in self.conversations if len(c) >= 2 * s.replay_turns][: s.replay_sessions]
        ours, baseline, tokens, baseline_tokens = [], [], [], []
        for r in range(s.repeats if s.baseline else 1):
            for engine in alternating("ours", "baseline", r) if s.baseline else ("ours",):
                if engine == "ours":
                    wall, generated = self._replay_here(sessions, f"replay-{r}")
                    ours.append(wall)
                    tokens.append(generated)
                else:
                    s.progress("replay on llama-cpp-python's Llama with LlamaRAMCache, requests serialised")
                    wall, generated = replay_on_llama_cpp_python(self.engine.config, self.fmt.spec, sessions, s)
                    baseline.append(wall)
                    baseline_tokens.append(generated)
        results = {"replay_s": statistics.median(ours), "replay_tokens": float(statistics.median(tokens))}
        if baseline:
            results |= {"replay_s_llama_cpp_python": statistics.median(baseline)}
            results |= paired(
                "replay_speedup_vs_llama_cpp_python", [b / o for o, b in zip(ours, baseline, strict=True)]
            )
        return results

    def _replay_here(self, sessions: list[list[str]], tag: str) -> tuple[float, int]:
        """Every session at once on this engine, whole history each turn; wall time and tokens generated."""
        s = self.settings
        generated = [0]
        lock = threading.Lock()

        def one_session(k: int, texts: list[str]) -> None:
            history: list[ChatMessage] = []
            for turn in range(s.replay_turns):
                history.append(ChatMessage("user", texts[2 * turn]))
                reply = self._generate(f"{tag}-{k}", self.fmt.render(history), s.reply_tokens)
                history.append(ChatMessage("assistant", reply.text, tuple(reply.token_ids)))
                with lock:
                    generated[0] += len(reply.token_ids)

        wall = run_parallel([partial(one_session, k, t) for k, t in enumerate(sessions)])
        return wall, generated[0]


def replay_on_llama_cpp_python(
    config: EngineConfig, spec: TemplateSpec, sessions: list[list[str]], s: BenchSettings
) -> tuple[float, int]:
    """The same replay on one shared `llama_cpp.Llama` with its `LlamaRAMCache`, one request at a time."""
    from llama_cpp import Llama, LlamaRAMCache, StoppingCriteriaList

    llm = Llama(
        model_path=str(config.model_file().path),
        n_ctx=config.N_CTX,
        n_threads=config.N_THREADS or None,
        n_gpu_layers=config.N_GPU_LAYERS,
        verbose=False,
    )
    # Each LlamaRAMCache entry also holds a copy of Llama.scores (prompt tokens x vocabulary floats: ~1 MiB a
    # token for Gemma's 262k vocabulary) that its byte budget does not count; 64 MiB of counted state (~7
    # sessions) is about 4 GiB of real memory here. Larger budgets ran this machine (24 GiB) out of memory.
    llm.set_cache(LlamaRAMCache(capacity_bytes=BASELINE_CACHE_BYTES))
    fmt = ChatFormat(llm, spec)
    stop_ids = fmt.stop_token_ids
    stopping = StoppingCriteriaList([lambda ids, logits: int(ids[-1]) in stop_ids])
    histories: list[list[ChatMessage]] = [[] for _ in sessions]
    generated = 0
    start = time.perf_counter()
    for turn in range(s.replay_turns):
        for k, texts in enumerate(sessions):
            histories[k].append(ChatMessage("user", texts[2 * turn]))
            completion = llm.create_completion(
                prompt=fmt.render(histories[k]),
                max_tokens=s.reply_tokens,
                temperature=0,
                repeat_penalty=1.1,
                stopping_criteria=stopping,
            )
            text = completion["choices"][0]["text"]  # type: ignore[index]
            generated += completion["usage"]["completion_tokens"]  # type: ignore[index]
            histories[k].append(ChatMessage("assistant", text))
    wall = time.perf_counter() - start
    llm.close()
    return wall, generated


def calibrate(
    engine: BatchEngine, conversations: Sequence[list[str]], *, batch: int = 8, decode_tokens: int = 32
) -> dict:
    """The figures a cluster simulation needs about one node, measured on its engine: prefill speed, decode
    step time alone and with `batch` sequences, slots, and how many tokens of prefix cache it holds."""
    fmt, config = engine.chat_format, engine.config
    run = f"calibrate-{uuid.uuid4().hex[:8]}"  # sessions of their own: not restored from an earlier run's disk tier
    prompt = fmt.render(long_conversation(fmt, conversations, 1024))
    cold = engine.generate(session_key=f"{run}-prefill", prompt=prompt, sampling=greedy(1, cache_prompt=False))
    kv_bytes_per_token = max(engine.runtime.seq_state_bytes(i) for i in range(config.MAX_RESIDENT_SESSIONS)) / len(
        prompt
    )
    short = [fmt.render(as_chat(c[:1])) for c in conversations[:batch]]
    one = engine.generate(session_key=f"{run}-0", prompt=short[0], sampling=greedy(decode_tokens))
    rates: list[float] = []

    def decode(k: int) -> None:
        generation = engine.generate(session_key=f"{run}-{k}", prompt=short[k], sampling=greedy(decode_tokens))
        rates.append(generation.decode_tokens_per_s)

    run_parallel([partial(decode, k) for k in range(batch)])
    step_one = 1000 / one.decode_tokens_per_s
    step_batch = 1000 / statistics.median(rates)
    return {
        "prefill_tokens_per_s": len(prompt) / (cold.prefill_ms / 1000),
        "step_ms_one": step_one,
        "step_ms_per_extra": max(0.0, (step_batch - step_one) / (batch - 1)),
        "slots": config.MAX_CONCURRENT,
        "kv_tokens": config.kv_cells + config.SPILL_BUDGET_MB * 2**20 / kv_bytes_per_token,
        "kv_bytes_per_token": kv_bytes_per_token,
        "n_threads": config.N_THREADS,
    }


def calibrate_colocated(config: EngineConfig, conversations: Sequence[list[str]], *, nodes: int) -> dict:
    """`calibrate` in `nodes` processes at once, as that many nodes sharing one machine run: the median of
    each figure. One process is the plain measurement."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(nodes) as pool:
        results = pool.starmap(_calibrate_process, [(config, conversations)] * nodes)
    return {key: type(value)(statistics.median(r[key] for r in results)) for key, value in results[0].items()}


def _calibrate_process(config: EngineConfig, conversations: Sequence[list[str]]) -> dict:
    engine = BatchEngine(config)
    try:
        return calibrate(engine, conversations)
    finally:
        engine.close()
