"""Greedy decoding with llama.cpp's repetition penalties, read straight from the logits.

llama.cpp's chain for the same choice (penalties, then greedy) first copies every vocabulary entry's
logit into a candidate array, then looks each of them up in its window's hash map: 262,144 entries a
sequence a token for Gemma 3. The penalties only ever touch the tokens in the window (at most
PENALTY_LAST_N), so here only those are penalised, in float32 as llama.cpp does, and one argmax picks the
token; ties go to the lowest token id, as llama.cpp's greedy scan does. The tokens are the same.
"""

from collections import Counter, deque

import numpy as np

from inference.types import Sampling

# The tokens the penalties look at (the prompt's last ones, then the reply's), as llama-server's default.
PENALTY_LAST_N = 64


class PenalizedGreedy:
    """One sequence's greedy sampler: its penalty window and the argmax."""

    def __init__(self, sampling: Sampling) -> None:
        self.repeat = np.float32(sampling.repeat_penalty)
        # Every token in the window has a count of at least 1, so its presence penalty always applies.
        self.frequency = np.float32(sampling.frequency_penalty)
        self.presence = np.float32(sampling.presence_penalty)
        self.enabled = self.repeat != 1 or self.frequency != 0 or self.presence != 0
        self.window: deque[int] = deque(maxlen=PENALTY_LAST_N)
        self.counts: Counter[int] = Counter()

    def choose(self, logits: np.ndarray) -> int:
        """The next token from one sequence's float32 logits, which are overwritten where penalised."""
        if self.enabled and self.counts:
            ids = np.fromiter(self.counts.keys(), dtype=np.intp, count=len(self.counts))
            counts = np.fromiter(self.counts.values(), dtype=np.float32, count=len(self.counts))
            values = logits[ids]
            values = np.where(values <= 0, values * self.repeat, values / self.repeat)
            logits[ids] = values - (counts * self.frequency + self.presence)
        token = int(logits.argmax())
        self.accept(token)
        return token

    def accept(self, token: int) -> None:
        """Count a token into the window (the prompt's last ones, then each generated one), dropping the oldest
        when the window is full."""
        if len(self.window) == PENALTY_LAST_N:
            oldest = self.window[0]
            self.counts[oldest] -= 1
            if not self.counts[oldest]:
                del self.counts[oldest]
        self.window.append(token)
        self.counts[token] += 1
