"""Render chat messages into exact prompt tokens, segment by segment, in the model's own template.

A prefix cache only hits if tokens are identical, so the prompt is never
re-rendered as one string. `inference.chat_templates` lays a prompt out in
pieces; each is tokenized on its own: template markers with special tokens
enabled, message text with them disabled (a user who types `<|im_end|>` gets
those characters as text, not control), and an assistant message's stored
token ids are reused verbatim. Turn N+1's prompt then starts with turn N's
prompt plus its reply, token for token.
"""

from collections.abc import Sequence
from functools import cache, lru_cache
from typing import Protocol

from inference.chat_templates import ChatMessage, Piece, TemplateSpec, layout, message_pieces, template_spec_for


class Tokenizer(Protocol):
    def tokenize(self, text: bytes, add_bos: bool = True, special: bool = False) -> list[int]: ...

    def token_bos(self) -> int: ...

    def token_eos(self) -> int: ...

    def detokenize(self, tokens: list[int], *, special: bool = False) -> bytes: ...


class ChatFormat:
    """A model's chat template, rendered to tokens piece by piece."""

    def __init__(self, tokenizer: Tokenizer, spec: TemplateSpec) -> None:
        self._tokenizer = tokenizer
        self.spec = spec
        self._marker = cache(self._tokenize_marker)
        self._count_one = lru_cache(maxsize=65536)(self._count_message)
        self._text_tokens = lru_cache(maxsize=65536)(self._tokenize_text)
        self._display_pieces: dict[int, bytes] = {}  # at most the vocabulary
        single = [ids[0] for ids in map(self._marker, spec.stop) if len(ids) == 1]
        self.stop_token_ids = frozenset({tokenizer.token_eos(), *single})

    @property
    def template(self) -> str:
        return self.spec.name

    def _tokenize_marker(self, marker: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.tokenize(marker.encode(), add_bos=False, special=True))

    def display(self, tokens: Sequence[int]) -> str:
        """The tokens as text with the template markers visible (for inspecting a prompt), from each token's
        piece, read from llama.cpp once per token id: llama-cpp-python's `detokenize` makes a C call per token
        (a GIL hand-over each, beside the engine thread) for every token of every prompt recorded."""
        pieces = self._display_pieces
        text = b"".join([pieces[t] if t in pieces else self._display_piece(t) for t in tokens])
        return text.decode("utf-8", errors="replace")

    def _display_piece(self, token: int) -> bytes:
        piece = self._display_pieces[token] = self._tokenizer.detokenize([token], special=True)
        return piece

    def text_tokens(self, text: str) -> list[int]:
        """Tokens for text a person or the model wrote: special-token syntax stays plain text. Cached: every
        prompt of a conversation tokenises the same history again."""
        return list(self._text_tokens(text))

    def _tokenize_text(self, text: str) -> tuple[int, ...]:
        return tuple(self._tokenizer.tokenize(text.encode(), add_bos=False, special=False))

    def _tokens(self, pieces: Sequence[Piece]) -> list[int]:
        tokens: list[int] = []
        for piece in pieces:
            if piece.bos:
                tokens.append(self._tokenizer.token_bos())
            elif piece.marker:
                tokens += self._marker(piece.text)
            elif piece.token_ids is not None:
                tokens += piece.token_ids
            elif piece.text:
                tokens += self._text_tokens(piece.text)
        return tokens

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True) -> list[int]:
        """The prompt's tokens: the template's layout, each piece tokenized on its own."""
        return self._tokens(layout(self.spec, messages, generation_prompt=add_generation_prompt))

    def annotated(self, messages: Sequence[ChatMessage]) -> list[tuple[Piece, int]]:
        """The prompt's pieces in order, each with the number of its tokens in `render`'s output."""
        return [(piece, len(self._tokens([piece]))) for piece in layout(self.spec, messages)]

    def count(self, messages: Sequence[ChatMessage]) -> int:
        """Tokens these messages add to a prompt; additive, so segments can be measured one by one.
        Each message is counted once per process (strategies measure the same history every turn)."""
        return sum(self._count_one(m) for m in messages)

    def _count_message(self, m: ChatMessage) -> int:
        return len(self._tokens(message_pieces(self.spec, m)))

    @property
    def overhead(self) -> int:
        """The most tokens a prompt has besides its messages: BOS, the template's default system message (if
        it has one) and the opening of the model's turn. Strategies budget with it."""
        return len(self.render([]))

    def overhead_of(self, messages: Sequence[ChatMessage]) -> int:
        """The template's own tokens in the prompt of these messages: `overhead`, less the default system
        message where a system message of the conversation leads."""
        leads = bool(messages) and messages[0].role == "system" and bool(self.spec.default_system)
        return self.overhead - (self.count([ChatMessage("system", self.spec.default_system)]) if leads else 0)


def chat_format_for_model(tokenizer: Tokenizer, *, template: str, forced: str = "") -> ChatFormat:
    """The chat format of a model from its Jinja template (`tokenizer.chat_template`), checked against it;
    `forced` names a family instead (CHAT_TEMPLATE). Raises UnsupportedTemplate."""
    bos, eos = (
        tokenizer.detokenize([t], special=True).decode() for t in (tokenizer.token_bos(), tokenizer.token_eos())
    )
    return ChatFormat(tokenizer, template_spec_for(template, bos=bos, eos=eos, name=forced))
