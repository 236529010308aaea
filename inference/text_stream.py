"""Generated tokens into text as they arrive: UTF-8 split across tokens, and stop strings."""

import codecs


class TextAssembler:
    """Decodes token pieces incrementally and holds back text that might begin a stop string.

    `add` returns the text that is now safe to show. When a stop string appears,
    `stopped` is set and `kept_tokens` says how many tokens the reply keeps: those
    that end before the stop string, so the stored text and token ids agree.
    """

    def __init__(self, stop: tuple[str, ...] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._token_ends: list[int] = []
        self._emitted = 0
        self.text = ""
        self.stopped = False
        self.kept_tokens = 0

    def add(self, piece: bytes) -> str:
        self.text += self._decoder.decode(piece)
        self._token_ends.append(len(self.text))
        self.kept_tokens = len(self._token_ends)
        if self._stop and (hit := self._find_stop()) is not None:
            self.stopped = True
            self.kept_tokens = sum(1 for end in self._token_ends if end <= hit)
            self.text = self.text[: self._token_ends[self.kept_tokens - 1]] if self.kept_tokens else ""
            return self._emit(len(self.text))
        return self._emit(len(self.text) - self._hold)

    def finish(self) -> str:
        """Everything not yet returned (the held-back tail), once the reply is over."""
        if not self.stopped:
            self.text += self._decoder.decode(b"", final=True)
        return self._emit(len(self.text))

    def _find_stop(self) -> int | None:
        start = max(0, self._emitted - self._hold)
        hits = [i for s in self._stop if (i := self.text.find(s, start)) != -1]
        return min(hits, default=None)

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out
