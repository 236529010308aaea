"""An OpenAI chat-completions request, checked: every field we honour, a clear 400 for anything else."""

import json
from dataclasses import dataclass, field
from functools import cache
from typing import Any

from django.conf import settings

from chatapp.api.errors import ApiError
from chatapp.validation import control_character_in
from inference.config import EngineConfig

SAMPLING_LIMITS = {
    "temperature": (0.0, 2.0),
    "top_p": (0.0, 1.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
}
SUPPORTED = {
    "model",
    "messages",
    "stream",
    "stream_options",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "user",
    "n",
    "ignore_eos",  # vLLM's and llama-server's extension: write on to max_tokens
    *SAMPLING_LIMITS,
}
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


@dataclass
class ChatRequest:
    model: str
    system: str  # all system and developer messages, joined
    history: list[tuple[str, str]]  # (role, text) of user and assistant messages, the new user message last
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)


def parse_chat_request(body: bytes) -> ChatRequest:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
        raise ApiError("We could not parse the JSON body of your request: it must be a JSON object.") from exc
    if not isinstance(data, dict):
        raise ApiError("The request body must be a JSON object.")
    try:
        json.dumps(data, ensure_ascii=False).encode()
    except UnicodeEncodeError as exc:  # JSON's \ud800-style escapes can name half a character
        raise ApiError("The request contains invalid Unicode (an unpaired surrogate).") from exc
    unsupported = sorted(set(data) - SUPPORTED)
    if unsupported:
        raise ApiError(
            f"Unsupported parameter: {unsupported[0]!r}. Supported: {', '.join(sorted(SUPPORTED))}.",
            param=unsupported[0],
            code="unsupported_parameter",
        )
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("You must provide a model parameter.", param="model")
    if data.get("n", 1) != 1:
        raise ApiError("Only n=1 is supported.", param="n", code="unsupported_value")
    system, history = _messages(data.get("messages"))
    stream = _typed(data, "stream", bool, False)
    options = _typed(data, "stream_options", dict, {})
    if options and not stream:
        raise ApiError("stream_options is only allowed with stream=true.", param="stream_options")
    user = _typed(data, "user", str, None)
    return ChatRequest(
        model=model,
        system=system,
        history=history,
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        user=user,
        sampling=_sampling(data),
    )


def _typed(data: dict, name: str, kind: type, default: Any) -> Any:
    value = data.get(name)
    if value is None:
        return default
    if type(value) is not kind:  # JSON values have exact types; this also keeps true out of integers
        raise ApiError(f"{name} must be of type {kind.__name__}.", param=name)
    return value


def _messages(messages: Any) -> tuple[str, list[tuple[str, str]]]:
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty array.", param="messages")
    system: list[str] = []
    history: list[tuple[str, str]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ApiError(f"messages[{i}] must be an object.", param=f"messages[{i}]")
        role = ROLES.get(message.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ApiError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}; got {message.get('role')!r}.",
                param=f"messages[{i}].role",
            )
        extra = set(message) - {"role", "content", "name"}
        if extra:
            raise ApiError(f"messages[{i}] has unsupported fields: {', '.join(sorted(extra))}.", param=f"messages[{i}]")
        text = _content(message.get("content"), i)
        _check_text(text, f"messages[{i}].content")
        if role == "system":
            system.append(text)
        else:
            history.append((role, text))
    if not history or history[-1][0] != "user":
        raise ApiError("The last message must be a user message.", param="messages")
    joined = "\n\n".join(system)
    _check_text(joined, "messages (system, joined)")
    return joined, history


def _check_text(text: str, param: str) -> None:
    """Any role's text: no control characters (NUL included) and no more than CHAT_MAX_MESSAGE_CHARS."""
    if found := control_character_in(text):
        raise ApiError(
            f"{param} contains the control character {found}; only tab, newline and carriage return are allowed.",
            param=param,
            code="invalid_characters",
        )
    limit = settings.CHAT_MAX_MESSAGE_CHARS
    if len(text) > limit:
        raise ApiError(f"{param} is {len(text):,} characters; the limit is {limit:,}.", param=param, code="too_long")


def _content(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ApiError(f"messages[{i}].content must be a string or text parts.", param=f"messages[{i}].content")


@cache
def _reply_token_cap() -> int:
    """MAX_REPLY_TOKENS as this process's environment sets it, read once: building the settings object
    parses the whole environment (about a millisecond, on the event loop of every request)."""
    return EngineConfig().MAX_REPLY_TOKENS


def _sampling(data: dict) -> dict[str, Any]:
    sampling: dict[str, Any] = {}
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ApiError("max_tokens must be a positive integer.", param="max_tokens")
        cap = _reply_token_cap()
        if max_tokens > cap:
            raise ApiError(
                f"max_tokens is {max_tokens}; this server writes at most {cap} tokens per reply (MAX_REPLY_TOKENS).",
                param="max_tokens",
                code="max_tokens_too_large",
            )
        sampling["max_tokens"] = max_tokens
    for name, (low, high) in SAMPLING_LIMITS.items():
        value = data.get(name)
        if value is None:
            continue
        if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
            raise ApiError(f"{name} must be a number from {low} to {high}.", param=name)
        sampling[name] = float(value)
    seed = data.get("seed")
    if seed is not None:
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**32:
            raise ApiError("seed must be an integer from 0 to 2**32 - 1.", param="seed")
        sampling["seed"] = seed
    stop = data.get("stop")
    if stop is not None:
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
            raise ApiError("stop must be a string or up to 4 non-empty strings.", param="stop")
        sampling["stop"] = stops
    ignore_eos = data.get("ignore_eos")
    if ignore_eos is not None:
        if not isinstance(ignore_eos, bool):
            raise ApiError("ignore_eos must be true or false.", param="ignore_eos")
        sampling["ignore_eos"] = ignore_eos
    return sampling
