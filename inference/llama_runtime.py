"""A thin layer over llama.cpp's C API: one model, one context with many sequences, one batch.

Only the engine thread calls into it. ctypes releases the GIL during each
C call, so Celery's task threads keep running while a batch decodes.
"""

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass

import llama_cpp
import numpy as np
from llama_cpp._internals import LlamaContext, LlamaModel, LlamaSampler
from llama_cpp._logger import set_verbose

from inference.config import EngineConfig
from inference.greedy import PENALTY_LAST_N, PenalizedGreedy
from inference.kv_disk import model_digest
from inference.types import Sampling


@dataclass(frozen=True)
class BatchEntry:
    token: int
    pos: int
    seq_id: int
    logits: bool


FLASH_ATTN_TYPES = {
    "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO,
    "on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
    "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
}


class DecodeError(RuntimeError):
    pass


class NoKVSlot(DecodeError):
    """llama_decode found no room for the batch in the KV cache."""


class LlamaRuntime:
    def __init__(self, config: EngineConfig) -> None:
        set_verbose(False)  # llama.cpp logs errors only
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = config.N_GPU_LAYERS
        # llama.cpp's repacked CPU weights use GEMM kernels whose summation order depends on how many
        # rows a batch has, so a session's greedy output could change with what it was batched with.
        model_params.use_extra_bufts = not config.BATCH_INVARIANT
        self.model_file = config.model_file()
        self.model = LlamaModel(path_model=str(self.model_file.path), params=model_params, verbose=False)
        self._pieces: dict[int, bytes] = {}
        threads = config.N_THREADS or os.cpu_count() or 1
        # A prompt's chunk may be 3 tokens under a step budget of 1 or 2 (scheduler._chunk_size).
        self.batch_capacity = max(config.step_token_budget, config.MAX_CONCURRENT, 3)
        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = config.kv_cells
        ctx_params.n_batch = self.batch_capacity
        ctx_params.n_ubatch = self.batch_capacity
        ctx_params.n_seq_max = config.MAX_RESIDENT_SESSIONS
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        # Full-size sliding-window layers keep a prefix reusable after its window has slid past.
        ctx_params.kv_unified = config.KV_UNIFIED
        ctx_params.swa_full = True
        ctx_params.flash_attn_type = FLASH_ATTN_TYPES[config.flash_attn]
        ctx_params.no_perf = True
        self.context = LlamaContext(model=self.model, params=ctx_params, verbose=False)
        self.ctx = self.context.ctx
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.kv_size = llama_cpp.llama_n_ctx(self.ctx)
        # The most cells one sequence can hold: the whole pool, or its own stream.
        self.seq_capacity = llama_cpp.llama_n_ctx_seq(self.ctx)
        self.n_vocab = self.model.n_vocab()
        self._batch = llama_cpp.llama_batch_init(self.batch_capacity, 0, 1)
        self._kv_unified = config.KV_UNIFIED
        self._flash_attn = config.flash_attn

    def state_fingerprint(self) -> dict[str, object]:
        """What a saved sequence state depends on: the weights, llama.cpp's version and the KV layout."""
        return {
            "model_sha256": model_digest(self.model_file.path),
            "llama_cpp": llama_cpp.__version__,
            "n_ctx_seq": self.seq_capacity,
            "kv_unified": self._kv_unified,
            "swa_full": True,
            # Flash attention stores V untransposed: a state saved with it on does not load with it off.
            "flash_attn": self._flash_attn,
        }

    def close(self) -> None:
        llama_cpp.llama_batch_free(self._batch)
        self.context.close()
        self.model.close()

    # Tokens and text -------------------------------------------------------

    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]:
        return self.model.tokenize(text, add_bos, special)

    def metadata(self) -> dict[str, str]:
        """The GGUF's key-value metadata (chat template, special tokens, training context)."""
        return self.model.metadata()

    def token_bos(self) -> int:
        return self.model.token_bos()

    def token_eos(self) -> int:
        return self.model.token_eos()

    def piece(self, token: int) -> bytes:
        """A sampled token's text (llama.cpp's piece, read once per token id)."""
        if (piece := self._pieces.get(token)) is None:
            piece = self._pieces[token] = self.model.detokenize([token])
        return piece

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> bytes:
        return self.model.detokenize(list(tokens), special=special)

    # Decoding -------------------------------------------------------------

    def decode(self, entries: Sequence[BatchEntry]) -> None:
        """Decode one batch; entry i's logits (if asked for) are then at index i."""
        batch = self._batch
        for i, entry in enumerate(entries):
            batch.token[i] = entry.token
            batch.pos[i] = entry.pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = entry.seq_id
            batch.logits[i] = entry.logits
        batch.n_tokens = len(entries)
        code = llama_cpp.llama_decode(self.ctx, batch)
        if code == 1:
            raise NoKVSlot("no KV cache slot for the batch")
        if code != 0:
            raise DecodeError(f"llama_decode returned {code}")

    def sampler(self, sampling: Sampling, prompt: Sequence[int]) -> LlamaSampler | PenalizedGreedy:
        """A sampler for one sequence: greedy in Python over the logits (inference/greedy.py), or llama.cpp's
        own chain (penalties, then top-k/top-p/temperature). Its penalties' window starts with the prompt's
        last PENALTY_LAST_N tokens, as llama-server's does (and vLLM's repetition penalty): a reply is held
        back from repeating what it answers, and the end of the turn it just read, not only itself."""
        history = prompt[-PENALTY_LAST_N:]
        if sampling.temperature <= 0:
            greedy = PenalizedGreedy(sampling)
            for token in history:
                greedy.accept(token)
            return greedy
        chain = self.penalties(sampling)
        chain.add_top_k(40)
        chain.add_top_p(sampling.top_p, 1)
        chain.add_temp(sampling.temperature)
        chain.add_dist(llama_cpp.LLAMA_DEFAULT_SEED if sampling.seed is None else sampling.seed)
        for token in history:
            llama_cpp.llama_sampler_accept(chain.sampler, token)
        return chain

    def penalties(self, sampling: Sampling) -> LlamaSampler:
        """llama.cpp's chain, so far with only its repetition penalties over the last PENALTY_LAST_N tokens."""
        chain = LlamaSampler()
        chain.add_penalties(
            n_vocab=self.n_vocab,
            penalty_last_n=PENALTY_LAST_N,
            penalty_repeat=sampling.repeat_penalty,
            penalty_freq=sampling.frequency_penalty,
            penalty_present=sampling.presence_penalty,
        )
        return chain

    def sample(self, sampler: LlamaSampler | PenalizedGreedy, index: int) -> int:
        """Sample from the logits of batch entry `index` (the sampler also records the token)."""
        if isinstance(sampler, PenalizedGreedy):
            return sampler.choose(self.logits(index))
        return llama_cpp.llama_sampler_sample(sampler.sampler, self.ctx, index)

    def logits(self, index: int) -> np.ndarray:
        """Batch entry `index`'s logits, in place: valid until the next decode."""
        pointer = llama_cpp.llama_get_logits_ith(self.ctx, index)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))

    # Sequences --------------------------------------------------------------

    def seq_truncate(self, seq_id: int, keep: int) -> None:
        """Drop the sequence's cells from position `keep` on (0: all of them)."""
        if not llama_cpp.llama_memory_seq_rm(self.memory, seq_id, keep, -1):
            raise DecodeError(f"could not truncate sequence {seq_id} at {keep}")

    def seq_copy_prefix(self, source: int, target: int, n_tokens: int) -> bool:
        """Give the empty sequence `target` the KV cells of `source`'s first `n_tokens` positions; False if
        llama.cpp found no room. In the shared pool the cells are shared (llama.cpp's seq_cp, no copy). With a
        stream per sequence, seq_cp copies only whole streams (N_CTX cells); the source's own cells are copied
        instead, through a host buffer, and the target cut back to the prefix."""
        if self._kv_unified:
            llama_cpp.llama_memory_seq_cp(self.memory, source, target, 0, n_tokens)
            return True
        if not self.seq_restore(target, self.seq_save(source)):
            return False
        self.seq_truncate(target, n_tokens)
        return True

    def seq_state_bytes(self, seq_id: int) -> int:
        return llama_cpp.llama_state_seq_get_size(self.ctx, seq_id)

    def seq_save(self, seq_id: int) -> ctypes.Array:
        """Copy a sequence's KV state into one host buffer (a single C memcpy, no Python loop)."""
        size = llama_cpp.llama_state_seq_get_size(self.ctx, seq_id)
        buffer = (ctypes.c_uint8 * size)()
        written = llama_cpp.llama_state_seq_get_data(self.ctx, buffer, size, seq_id)
        if written != size:
            raise DecodeError(f"saved {written} of {size} state bytes for sequence {seq_id}")
        return buffer

    def seq_restore(self, seq_id: int, buffer: ctypes.Array) -> bool:
        """Load a saved state into `seq_id`; False if llama.cpp found no room for it."""
        return llama_cpp.llama_state_seq_set_data(self.ctx, buffer, len(buffer), seq_id) > 0
