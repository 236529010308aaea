"""Engine knobs: one typed, validated object, each field read from the environment variable of the same
name (pydantic-settings). A value that is not of the field's type or out of its range stops the node at
start with a line naming the setting: `N_CTX=abc`, `MAX_CONCURRENT=0`."""

from dataclasses import replace
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from inference.model_files import ModelFile, resolve_model


class EngineConfig(BaseSettings):
    """How a node loads and runs its model. Every field has an env variable of the same name; keyword
    arguments take precedence over the environment."""

    model_config = SettingsConfigDict(frozen=True, case_sensitive=True, extra="forbid")

    # The model to serve: a packaged model's name (inference.model_files.PACKAGED; empty: the default), or
    # the name a MODEL_PATH file is served under (empty: the file's stem).
    MODEL: str = ""
    # Any GGUF file to serve instead of a packaged model.
    MODEL_PATH: str = ""
    # A template family (gemma, chatml, llama3) for a file without a chat template in its metadata;
    # empty: read the file's own template, and refuse the model if it is not supported.
    CHAT_TEMPLATE: str = ""
    # Context size in tokens: the longest prompt plus reply one session can hold.
    N_CTX: int = Field(4096, ge=16)
    # Sessions whose KV cache stays in the context at once; more are spilled to host RAM.
    MAX_RESIDENT_SESSIONS: int = Field(16, ge=1)
    # One shared pool of KV cells (KV_SIZE of them) instead of one N_CTX-cell stream per
    # resident session. Shared packs more short sessions, but every query then attends over
    # all resident sessions' cells (masked), so decoding slows as the cache fills.
    KV_UNIFIED: bool = False
    # Cells in the shared pool when KV_UNIFIED (else N_CTX x MAX_RESIDENT_SESSIONS).
    KV_SIZE: int = Field(32768, ge=16)
    # Host RAM for spilled sessions' KV state, in MiB; the least recently used beyond it are dropped.
    SPILL_BUDGET_MB: int = Field(2048, ge=0)
    # The disk tier: a directory for sessions' KV state files (empty: no disk tier). Nodes that share it
    # restore each other's sessions, so a session moved to another node, or a restarted one, skips its
    # prefill. Files from another model file or other context settings are ignored and deleted.
    KV_DISK_PATH: str = "var/kv-cache"
    # Disk for one model's files (a subdirectory each), in MiB, over all nodes sharing it; least recently used
    # files are deleted beyond it.
    KV_DISK_BUDGET_MB: int = Field(4096, ge=0)
    # An idle resident session's new tokens are written after this many seconds (0: only when it is
    # spilled, and at a clean shutdown). A node that is draining writes every idle session at once.
    KV_DISK_IDLE_S: float = Field(10.0, ge=0)
    # The node's name, recorded in the files it writes (a restore then says whether another node wrote it).
    NODE_NAME: str = Field("local", min_length=1)
    # Generations decoded together; further requests wait. Size the node's thread pool to it.
    MAX_CONCURRENT: int = Field(16, ge=1)
    # The same output for a session whatever else is batched with it: turns off llama.cpp's repacked
    # CPU weights (measured here: 14% slower single-stream decoding, no change at 16 sequences), and flash
    # attention (`flash_attn`).
    BATCH_INVARIANT: bool = True
    # Flash attention: "auto" (off while BATCH_INVARIANT; else llama.cpp decides when the context is made: on
    # wherever its backend has it, this CPU included), "on" (not with BATCH_INVARIANT) or "off".
    # Off decoded one SmolLM2 sequence 15-30% faster at 300-700 tokens of context (llama-bench), and
    # bench_stack's batched replay as fast on an AMD EPYC (AVX2), 1.48x faster on an Intel Xeon with
    # AVX-512 (README, sessions 35 and 38).
    FLASH_ATTN: Literal["auto", "on", "off"] = "auto"
    # Tokens in a step of the oldest prompt's chunk; a step of decoding takes one per sequence (`Scheduler.schedule`).
    # 0: 64 on a CPU, where a step costs about the same per token at any size and a small budget gives
    # first tokens sooner; 512 with layers on a GPU, where a large step costs little more than a small one.
    STEP_TOKEN_BUDGET: int = Field(0, ge=0)
    # Niceness of the engine thread and llama.cpp's compute threads (0: as the process). Positive lets the
    # short work a turn waits on (the node's task threads, the web process, Postgres, Redis on the same
    # cores) run as soon as it is ready. On bench_stack's 8x12 replay (4 interleaved pairs), 10 cut the
    # median time to first token by 14% but made the replay 4% slower: preempted compute threads stall
    # each other at llama.cpp's barriers. Off by default.
    COMPUTE_NICE: int = Field(0, ge=0, le=19)
    # CPU threads for llama.cpp (0: all cores).
    N_THREADS: int = Field(0, ge=0)
    # Layers offloaded to the GPU (-1: all); ignored by a CPU-only build.
    N_GPU_LAYERS: int = Field(0, ge=-1)
    # Longest reply in tokens.
    MAX_REPLY_TOKENS: int = Field(256, ge=1)
    # Replies always run to their max_tokens (Sampling.ignore_eos), for benchmarks and long-reply tests.
    IGNORE_EOS: bool = False
    # Sampling defaults; a request may override them.
    TEMPERATURE: float = Field(0.7, ge=0)
    TOP_P: float = Field(0.95, gt=0, le=1)
    # Mild penalty so small models do not loop.
    REPEAT_PENALTY: float = Field(1.1, gt=0)

    def model_file(self) -> "ModelFile":
        """The GGUF this config serves (raises inference.model_files.ModelNotFound)."""
        found = resolve_model(name=self.MODEL, path=self.MODEL_PATH)
        return replace(found, chat_template=self.CHAT_TEMPLATE or found.chat_template)

    def replace(self, **changes: Any) -> "EngineConfig":
        """A copy with `changes`, validated like the original (the environment is not read again)."""
        return type(self)(**(self.model_dump() | changes))

    @field_validator("FLASH_ATTN")
    @classmethod
    def _flash_attn_keeps_batches_invariant(cls, value: str, info: ValidationInfo) -> str:
        # info.data holds the fields declared above this one: BATCH_INVARIANT must stay declared first.
        if value == "on" and info.data.get("BATCH_INVARIANT"):
            raise ValueError("flash attention makes a session's output depend on its batch; needs BATCH_INVARIANT=off")
        return value

    @property
    def flash_attn(self) -> Literal["auto", "on", "off"]:
        """FLASH_ATTN as the context gets it. llama.cpp's CPU flash attention splits the cells of a sequence
        that decodes alone (one token, 512 cells or more) across its threads, and so sums them in another
        order than when the sequence decodes beside others: its logits moved by up to 0.85 here, which flips
        the near-ties of a small model. Without it, a sequence's logits are the same alone or batched."""
        return "off" if self.FLASH_ATTN == "auto" and self.BATCH_INVARIANT else self.FLASH_ATTN

    @property
    def step_token_budget(self) -> int:
        if self.STEP_TOKEN_BUDGET:
            return self.STEP_TOKEN_BUDGET
        return 512 if self.N_GPU_LAYERS else 64

    @property
    def kv_cells(self) -> int:
        return self.KV_SIZE if self.KV_UNIFIED else self.N_CTX * self.MAX_RESIDENT_SESSIONS


class BadEngineSetting(ValueError):
    """An engine setting from the environment is not valid; the message names each."""


def engine_config(**overrides: Any) -> EngineConfig:
    """The engine settings from the environment (and `overrides`), or BadEngineSetting saying which are
    wrong and why, one per line."""
    try:
        return EngineConfig(**overrides)
    except ValidationError as exc:
        lines = [f"{'.'.join(map(str, e['loc']))}={e.get('input')!r}: {e['msg']}" for e in exc.errors()]
        raise BadEngineSetting("Bad engine setting: " + "; ".join(lines)) from None
