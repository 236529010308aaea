"""Engine knobs: one typed object, each field read from the environment."""

import os
from dataclasses import dataclass, field


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _env_float(name: str, default: float) -> float:
    return float(os.environ.get(name, default))


@dataclass(frozen=True)
class EngineConfig:
    """How a node loads and runs its model. Every field has an env variable of the same name."""

    # GGUF file to load; empty means the packaged default model (inference.model_files).
    MODEL_PATH: str = field(default_factory=lambda: os.environ.get("MODEL_PATH", ""))
    # Context size in tokens: the longest prompt plus reply one session can hold.
    N_CTX: int = field(default_factory=lambda: _env_int("N_CTX", 4096))
    # CPU threads for llama.cpp (0: all cores).
    N_THREADS: int = field(default_factory=lambda: _env_int("N_THREADS", 0))
    # Layers offloaded to the GPU (-1: all); ignored by a CPU-only build.
    N_GPU_LAYERS: int = field(default_factory=lambda: _env_int("N_GPU_LAYERS", 0))
    # Longest reply in tokens.
    MAX_REPLY_TOKENS: int = field(default_factory=lambda: _env_int("MAX_REPLY_TOKENS", 256))
    # Sampling defaults; a request may override them.
    TEMPERATURE: float = field(default_factory=lambda: _env_float("TEMPERATURE", 0.7))
    TOP_P: float = field(default_factory=lambda: _env_float("TOP_P", 0.95))
    # Mild penalty so the small base model does not loop.
    REPEAT_PENALTY: float = field(default_factory=lambda: _env_float("REPEAT_PENALTY", 1.1))
