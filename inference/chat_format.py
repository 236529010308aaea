"""Render chat messages into exact prompt tokens, segment by segment.

A prefix cache only hits if tokens are identical, so the prompt is never
re-rendered as one string. Each piece is tokenized on its own: template
markers with special tokens enabled, message text with them disabled (a user
who types `<end_of_turn>` gets those characters as text, not control), and an
assistant message's stored token ids are reused verbatim. Turn N+1's prompt
then starts with turn N's prompt plus its reply, token for token.
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache, lru_cache
from typing import Literal, Protocol

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    text: str
    # The exact ids the model generated, for assistant messages that have them.
    token_ids: tuple[int, ...] | None = None


class Tokenizer(Protocol):
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]: ...

    def token_bos(self) -> int: ...

    def token_eos(self) -> int: ...

    def detokenize(self, tokens: list[int], *, special: bool = False) -> bytes: ...


class GemmaChatFormat:
    """Gemma's turn template: `<start_of_turn>{user|model}\\n{text}<end_of_turn>\\n`.

    Gemma has no system role; as in its official template, a system prompt
    opens the first user turn, followed by a blank line.
    """

    ROLE_NAMES = {"user": "user", "assistant": "model"}

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._marker = cache(self._tokenize_marker)
        self._count_one = lru_cache(maxsize=65536)(self._count_message)
        self._text_tokens = lru_cache(maxsize=65536)(self._tokenize_text)
        self.stop_token_ids = frozenset(
            {tokenizer.token_eos(), *self._marker("<end_of_turn>"), *self._marker("<start_of_turn>")}
        )

    def _tokenize_marker(self, marker: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.tokenize(marker.encode(), add_bos=False, special=True))

    def display(self, tokens: Sequence[int]) -> str:
        """The tokens as text with the template markers visible (for inspecting a prompt)."""
        return self._tokenizer.detokenize(list(tokens), special=True).decode("utf-8", errors="replace")

    def text_tokens(self, text: str) -> list[int]:
        """Tokens for text a person or the model wrote: special-token syntax stays plain text. Cached: every
        prompt of a conversation tokenises the same history again."""
        return list(self._text_tokens(text))

    def _tokenize_text(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.tokenize(text.encode(), add_bos=False, special=False))

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> list[int]:
        """The prompt: <bos>, then each turn; system texts open the first user turn, each tokenized on its own."""
        system = [m for m in messages if m.role == "system"]
        tokens = [self._tokenizer.token_bos()]
        for message in messages:
            if message.role == "system":
                continue
            tokens += self._marker(f"<start_of_turn>{self.ROLE_NAMES[message.role]}\n")
            if system and message.role == "user":
                for piece in system:
                    tokens += self._system_tokens(piece)
                system = []
            tokens += self._body(message)
            tokens += self._marker("<end_of_turn>\n")
        if add_generation_prompt:
            tokens += self._marker("<start_of_turn>model\n")
        return tokens

    def count(self, messages: Sequence[ChatMessage]) -> int:
        """Tokens these messages add to a prompt; additive, so segments can be measured one by one.
        Each message is counted once per process (strategies measure the same history every turn)."""
        return sum(self._count_one(m) for m in messages)

    def _count_message(self, m: ChatMessage) -> int:
        if m.role == "system":
            return len(self._system_tokens(m))
        opening = self._marker(f"<start_of_turn>{self.ROLE_NAMES[m.role]}\n")
        return len(opening) + len(self._body(m)) + len(self._marker("<end_of_turn>\n"))

    @property
    def overhead(self) -> int:
        """Tokens every prompt has besides its messages: <bos> and the opening of the model's turn."""
        return 1 + len(self._marker("<start_of_turn>model\n"))

    def _system_tokens(self, message: ChatMessage) -> list[int]:
        return self.text_tokens(message.text + "\n\n") if message.text else []

    def _body(self, message: ChatMessage) -> list[int]:
        return list(message.token_ids) if message.token_ids is not None else self.text_tokens(message.text)
