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
from functools import cache
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


class GemmaChatFormat:
    """Gemma's turn template: `<start_of_turn>{user|model}\\n{text}<end_of_turn>\\n`.

    Gemma has no system role; as in its official template, a system prompt
    opens the first user turn, followed by a blank line.
    """

    ROLE_NAMES = {"user": "user", "assistant": "model"}

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._marker = cache(self._tokenize_marker)
        self.stop_token_ids = frozenset(
            {tokenizer.token_eos(), *self._marker("<end_of_turn>"), *self._marker("<start_of_turn>")}
        )

    def _tokenize_marker(self, marker: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.tokenize(marker.encode(), add_bos=False, special=True))

    def text_tokens(self, text: str) -> list[int]:
        """Tokens for text a person or the model wrote: special-token syntax stays plain text."""
        return self._tokenizer.tokenize(text.encode(), add_bos=False, special=False)

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> list[int]:
        tokens = [self._tokenizer.token_bos()]
        system = [m for m in messages if m.role == "system"]
        pending_system = "\n\n".join(m.text for m in system if m.text)
        for message in messages:
            if message.role == "system":
                continue
            tokens += self._marker(f"<start_of_turn>{self.ROLE_NAMES[message.role]}\n")
            if pending_system and message.role == "user":
                tokens += self.text_tokens(pending_system + "\n\n")
                pending_system = ""
            if message.token_ids is not None:
                tokens += message.token_ids
            else:
                tokens += self.text_tokens(message.text)
            tokens += self._marker("<end_of_turn>\n")
        if add_generation_prompt:
            tokens += self._marker("<start_of_turn>model\n")
        return tokens
