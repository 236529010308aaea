"""Chat templates as segment layouts: which marker opens and closes each message, read from the model.

A GGUF carries its chat template as Jinja (`tokenizer.chat_template`). Rendering
that Jinja per prompt would give text, and text re-tokenised as a whole does
not keep prefixes exact, so a node instead recognises the template's family
and lays a prompt out piece by piece (`layout`): markers, message texts and
stored token ids, which `inference.chat_format` turns into tokens.
Recognising is not trusting: `template_spec_for` renders probe conversations
with the model's own Jinja (llama-cpp-python's `Jinja2ChatFormatter`) and
refuses the model unless the layout gives the same text. Nothing falls back
silently to another layout.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class ChatMessage:
    role: Role
    text: str
    # The exact ids the model generated, for assistant messages that have them.
    token_ids: tuple[int, ...] | None = None


class UnsupportedTemplate(RuntimeError):
    """The model's chat template is missing, of an unknown family, or renders unlike its family's layout."""


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    # The prompt opens with the vocabulary's BOS token.
    bos: bool
    # Each message is open[role] + text + close.
    open: dict[str, str]
    close: str
    # "message": system texts are messages of their own; "first_user": they open the first user turn,
    # each followed by a blank line (Gemma has no system role).
    system: Literal["message", "first_user"]
    # Roles whose text the template strips of surrounding whitespace.
    trim: frozenset[str]
    # Markers that end the model's turn (besides the vocabulary's EOS).
    stop: tuple[str, ...]
    # A system message the template adds when a conversation starts without one (SmolLM2, Qwen).
    default_system: str = ""


GEMMA = TemplateSpec(
    name="gemma",
    bos=True,
    open={"user": "<start_of_turn>user\n", "assistant": "<start_of_turn>model\n"},
    close="<end_of_turn>\n",
    system="first_user",
    trim=frozenset({"user", "assistant"}),
    stop=("<end_of_turn>", "<start_of_turn>"),
)
CHATML = TemplateSpec(
    name="chatml",
    bos=False,
    open={role: f"<|im_start|>{role}\n" for role in ("system", "user", "assistant")},
    close="<|im_end|>\n",
    system="message",
    trim=frozenset(),
    stop=("<|im_end|>", "<|im_start|>"),
)
LLAMA3 = TemplateSpec(
    name="llama3",
    bos=True,
    open={role: f"<|start_header_id|>{role}<|end_header_id|>\n\n" for role in ("system", "user", "assistant")},
    close="<|eot_id|>",
    system="message",
    trim=frozenset({"system", "user", "assistant"}),
    stop=("<|eot_id|>", "<|start_header_id|>"),
)
SPECS = {spec.name: spec for spec in (GEMMA, CHATML, LLAMA3)}
# How each family's Jinja template is told apart: a marker only it uses.
_SIGNATURES = (("<start_of_turn>", GEMMA), ("<|im_start|>", CHATML), ("<|start_header_id|>", LLAMA3))


@dataclass(frozen=True)
class Piece:
    """One part of a laid-out prompt: a template marker, a message text, stored token ids, or BOS."""

    text: str = ""
    marker: bool = False
    token_ids: tuple[int, ...] | None = None
    bos: bool = False
    # The index of the message it belongs to in the laid-out list (None: the template's own).
    owner: int | None = None


def message_pieces(spec: TemplateSpec, message: ChatMessage) -> list[Piece]:
    """The pieces one message adds to a prompt wherever it stands (counts are additive per message)."""
    if message.role == "system" and spec.system == "first_user":
        return [Piece(message.text + "\n\n")] if message.text else []
    text = message.text.strip() if message.role in spec.trim else message.text
    body = Piece(text, token_ids=message.token_ids)
    return [Piece(spec.open[message.role], marker=True), body, Piece(spec.close, marker=True)]


def layout(spec: TemplateSpec, messages: Sequence[ChatMessage], *, generation_prompt: bool = True) -> list[Piece]:
    """The whole prompt as pieces, in order."""
    pieces = [Piece(bos=True)] if spec.bos else []
    if spec.default_system and (not messages or messages[0].role != "system"):
        pieces += message_pieces(spec, ChatMessage("system", spec.default_system))
    held: list[Piece] = []  # system texts waiting for the first user turn ("first_user" templates)
    for index, message in enumerate(messages):
        own = [replace(piece, owner=index) for piece in message_pieces(spec, message)]
        if message.role == "system" and spec.system == "first_user":
            held += own
            continue
        if held and message.role == "user":
            own, held = [own[0], *held, *own[1:]], []
        pieces += own
    if generation_prompt:
        pieces.append(Piece(spec.open["assistant"], marker=True))
    return pieces


def render_text(spec: TemplateSpec, messages: Sequence[ChatMessage], *, bos: str) -> str:
    """The layout as text, as the model's Jinja would render it (stored token ids count as their text)."""
    return "".join(bos if piece.bos else piece.text for piece in layout(spec, messages))


def render_jinja(template: str, messages: Sequence[ChatMessage], *, bos: str, eos: str) -> str:
    """The model's own Jinja rendering, with the generation prompt."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    formatter = Jinja2ChatFormatter(template=template, bos_token=bos, eos_token=eos, add_generation_prompt=True)
    chat: Any = [{"role": m.role, "content": m.text} for m in messages]
    return formatter(messages=chat).prompt


# Probe conversations for the check against the model's Jinja: with and without a system prompt, one
# exchange or several. Texts have no surrounding whitespace, so trimming templates render them as is.
_PROBES: tuple[tuple[ChatMessage, ...], ...] = (
    (ChatMessage("user", "Hello there."),),
    (ChatMessage("system", "Be brief."), ChatMessage("user", "Hi!")),
    (ChatMessage("user", "What is 2+2?"), ChatMessage("assistant", "It is 4."), ChatMessage("user", "And 3+3?")),
    (
        ChatMessage("system", "You answer in French."),
        ChatMessage("user", "One"),
        ChatMessage("assistant", "Un"),
        ChatMessage("user", "Two"),
    ),
)


def template_label(template: str) -> str:
    """A short, stable name for a template in messages: its first line and a hash of the whole."""
    first = template.strip().splitlines()[0][:60] if template.strip() else "(empty)"
    return f"{first!r} (sha256 {hashlib.sha256(template.encode()).hexdigest()[:10]})"


def template_spec_for(template: str, *, bos: str, eos: str, name: str = "") -> TemplateSpec:
    """The layout of this Jinja chat template, checked against it on probe conversations; `name` forces a
    family (CHAT_TEMPLATE, for a file without a template), checked against llama.cpp's built-in one.

    Raises UnsupportedTemplate naming the template when no supported family renders like it.
    """
    supported = ", ".join(SPECS)
    if name:
        if name not in SPECS:
            raise UnsupportedTemplate(f"CHAT_TEMPLATE={name} is not one of {supported}.")
        spec = SPECS[name]
    elif not template:
        raise UnsupportedTemplate(
            f"The model has no chat template (tokenizer.chat_template); set CHAT_TEMPLATE to one of {supported}."
        )
    else:
        found = next((spec for marker, spec in _SIGNATURES if marker in template), None)
        if found is None:
            raise UnsupportedTemplate(
                f"The chat template {template_label(template)} is not supported ({supported} are)."
            )
        spec = found
    if template:
        spec = _with_default_system(spec, template, bos=bos, eos=eos)
    for probe in _PROBES:
        if template:
            expected, source = (
                render_jinja(template, probe, bos=bos, eos=eos),
                f"The chat template {template_label(template)}",
            )
        else:
            expected, source = render_builtin(spec.name, probe, bos=bos), f"llama.cpp's built-in {spec.name} template"
        got = render_text(spec, probe, bos=bos)
        if expected != got:
            at = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b), len(got))
            raise UnsupportedTemplate(
                f"{source} looks like {spec.name} but renders differently from character {at}: "
                f"{expected[at : at + 40]!r} expected, {got[at : at + 40]!r} laid out. It is not supported."
            )
    return spec


def _with_default_system(spec: TemplateSpec, template: str, *, bos: str, eos: str) -> TemplateSpec:
    """Read the system message the template adds to a conversation that has none."""
    if spec.system != "message":
        return spec
    rendered = render_jinja(template, (ChatMessage("user", "x"),), bos=bos, eos=eos)
    head = rendered.split(spec.open["user"] + "x")[0].removeprefix(bos if spec.bos else "")
    opening = spec.open["system"]
    if head.startswith(opening) and head.endswith(spec.close):
        return replace(spec, default_system=head[len(opening) : -len(spec.close)])
    return spec


def render_builtin(name: str, messages: Sequence[ChatMessage], *, bos: str) -> str:
    """llama.cpp's own C++ rendering of a template family it knows by name (what llama-server's
    `--chat-template NAME` uses), with the generation prompt; BOS, which llama.cpp adds when it
    tokenizes, is put first here for families that open with it."""
    import ctypes

    import llama_cpp

    chat = (llama_cpp.llama_chat_message * len(messages))(
        *(llama_cpp.llama_chat_message(m.role.encode(), m.text.encode()) for m in messages)
    )
    size = 256 + 2 * sum(len(m.text.encode()) for m in messages)
    for _ in range(2):  # llama.cpp answers a buffer too small with the size it needs
        buffer = ctypes.create_string_buffer(size)
        written = llama_cpp.llama_chat_apply_template(name.encode(), chat, len(messages), True, buffer, size)
        if written < 0:
            raise UnsupportedTemplate(f"llama.cpp has no built-in chat template called {name!r}.")
        if written <= size:
            break
        size = written
    return (bos if SPECS[name].bos else "") + buffer.raw[:written].decode()
