"""Engine knobs: one typed object, each field read from the environment."""

import os
from dataclasses import dataclass, field, replace

from inference.model_files import ModelFile, resolve_model


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


def _env_bool(name: str, default: bool) -> bool:
    return os.environ.get(name, str(default)).strip().lower() in {"1", "true", "on", "yes"}


@dataclass(frozen=True)
class EngineConfig:
    """How a node loads and runs its model. Every field has an env variable of the same name."""

    # The model to serve: a packaged model's name (inference.model_files.PACKAGED; empty: the default), or
    # the name a MODEL_PATH file is served under (empty: the file's stem).
    MODEL: str = field(default_factory=lambda: os.environ.get("MODEL", ""))
    # Any GGUF file to serve instead of a packaged model.
    MODEL_PATH: str = field(default_factory=lambda: os.environ.get("MODEL_PATH", ""))
    # A template family (gemma, chatml, llama3) for a file without a chat template in its metadata;
    # empty: read the file's own template, and refuse the model if it is not supported.
    CHAT_TEMPLATE: str = field(default_factory=lambda: os.environ.get("CHAT_TEMPLATE", ""))
    # Context size in tokens: the longest prompt plus reply one session can hold.
    N_CTX: int = field(default_factory=lambda: _env_int("N_CTX", 4096))
    # Sessions whose KV cache stays in the context at once; more are spilled to host RAM.
    MAX_RESIDENT_SESSIONS: int = field(default_factory=lambda: _env_int("MAX_RESIDENT_SESSIONS", 16))
    # One shared pool of KV cells (KV_SIZE of them) instead of one N_CTX-cell stream per
    # resident session. Shared packs more short sessions, but every query then attends over
    # all resident sessions' cells (masked), so decoding slows as the cache fills.
    KV_UNIFIED: bool = field(default_factory=lambda: _env_bool("KV_UNIFIED", False))
    # Cells in the shared pool when KV_UNIFIED (else N_CTX x MAX_RESIDENT_SESSIONS).
    KV_SIZE: int = field(default_factory=lambda: _env_int("KV_SIZE", 32768))
    # Host RAM for spilled sessions' KV state, in MiB; the least recently used beyond it are dropped.
    SPILL_BUDGET_MB: int = field(default_factory=lambda: _env_int("SPILL_BUDGET_MB", 2048))
    # The disk tier: a directory for sessions' KV state files (empty: no disk tier). Nodes that share it
    # restore each other's sessions, so a session moved to another node, or a restarted one, skips its
    # prefill. Files from another model file or other context settings are ignored and deleted.
    KV_DISK_PATH: str = field(default_factory=lambda: os.environ.get("KV_DISK_PATH", "var/kv-cache"))
    # Disk for one model's files (a subdirectory each), in MiB, over all nodes sharing it; least recently used
    # files are deleted beyond it.
    KV_DISK_BUDGET_MB: int = field(default_factory=lambda: _env_int("KV_DISK_BUDGET_MB", 4096))
    # An idle resident session's new tokens are written after this many seconds (0: only when it is
    # spilled, and at a clean shutdown). A node that is draining writes every idle session at once.
    KV_DISK_IDLE_S: float = field(default_factory=lambda: _env_float("KV_DISK_IDLE_S", 10.0))
    # The node's name, recorded in the files it writes (a restore then says whether another node wrote it).
    NODE_NAME: str = field(default_factory=lambda: os.environ.get("NODE_NAME", "local"))
    # Generations decoded together; further requests wait. Size the node's thread pool to it.
    MAX_CONCURRENT: int = field(default_factory=lambda: _env_int("MAX_CONCURRENT", 16))
    # The same output for a session whatever else is batched with it: turns off llama.cpp's repacked
    # CPU weights (measured here: 14% slower single-stream decoding, no change at 16 sequences).
    BATCH_INVARIANT: bool = field(default_factory=lambda: _env_bool("BATCH_INVARIANT", True))
    # Tokens per llama_decode step: one per decoding sequence, the rest prefill chunks.
    STEP_TOKEN_BUDGET: int = field(default_factory=lambda: _env_int("STEP_TOKEN_BUDGET", 512))
    # Niceness of the engine thread and llama.cpp's compute threads (0: as the process). Positive lets the
    # short work a turn waits on (the node's task threads, the web process, Postgres, Redis on the same
    # cores) run as soon as it is ready. On bench_stack's 8x12 replay (4 interleaved pairs), 10 cut the
    # median time to first token by 14% but made the replay 4% slower: preempted compute threads stall
    # each other at llama.cpp's barriers. Off by default.
    COMPUTE_NICE: int = field(default_factory=lambda: _env_int("COMPUTE_NICE", 0))
    # CPU threads for llama.cpp (0: all cores).
    N_THREADS: int = field(default_factory=lambda: _env_int("N_THREADS", 0))
    # Layers offloaded to the GPU (-1: all); ignored by a CPU-only build.
    N_GPU_LAYERS: int = field(default_factory=lambda: _env_int("N_GPU_LAYERS", 0))
    # Longest reply in tokens.
    MAX_REPLY_TOKENS: int = field(default_factory=lambda: _env_int("MAX_REPLY_TOKENS", 256))
    # Replies always run to their max_tokens (Sampling.ignore_eos), for benchmarks and long-reply tests.
    IGNORE_EOS: bool = field(default_factory=lambda: _env_bool("IGNORE_EOS", False))
    # Sampling defaults; a request may override them.
    TEMPERATURE: float = field(default_factory=lambda: _env_float("TEMPERATURE", 0.7))
    TOP_P: float = field(default_factory=lambda: _env_float("TOP_P", 0.95))
    # Mild penalty so small models do not loop.
    REPEAT_PENALTY: float = field(default_factory=lambda: _env_float("REPEAT_PENALTY", 1.1))

    def model_file(self) -> "ModelFile":
        """The GGUF this config serves (raises inference.model_files.ModelNotFound)."""
        found = resolve_model(name=self.MODEL, path=self.MODEL_PATH)
        return replace(found, chat_template=self.CHAT_TEMPLATE or found.chat_template)

    @property
    def kv_cells(self) -> int:
        return self.KV_SIZE if self.KV_UNIFIED else self.N_CTX * self.MAX_RESIDENT_SESSIONS
