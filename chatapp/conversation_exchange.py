"""A conversation as JSON in OpenAI's `messages` format, out and in: what a user exports from one chat
UI and imports into another. Export reads; import checks everything before `services.conversation_import`
stores anything."""

import json
from dataclasses import dataclass
from typing import Any

from django.utils import timezone

from chatapp.models import Conversation
from chatapp.services import ImportedMessage
from chatapp.validation import TurnRejected

FORMAT = "openai-messages"


def conversation_export(conversation: Conversation) -> dict[str, Any]:
    """The conversation's system prompt (if it has its own) and its messages in order, as OpenAI's chat
    API takes them, with its title, model and strategy alongside."""
    messages = [{"role": "system", "content": conversation.system_prompt}] if conversation.system_prompt else []
    messages += [
        {"role": role, "content": content}
        for role, content in conversation.messages.order_by("created_at", "id").values_list("role", "content")
    ]
    return {
        "format": FORMAT,
        "title": conversation.title,
        "model": conversation.model,
        "strategy": conversation.strategy,
        "messages": messages,
    }


@dataclass(frozen=True)
class ParsedImport:
    title: str
    system_prompt: str
    messages: list[ImportedMessage]


def parse_import(raw: bytes) -> ParsedImport:
    """An exported conversation (or a bare `messages` list); TurnRejected saying what is wrong. Message
    texts are checked again by the import service, like typed ones."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TurnRejected(f"The file is not JSON: {exc}.") from exc
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise TurnRejected('Expected an object with a "messages" list (OpenAI\'s chat format).')
    title = data.get("title") or ""
    if not isinstance(title, str):
        raise TurnRejected("The title must be text.")
    system: list[str] = []
    messages: list[ImportedMessage] = []
    now = timezone.now()
    for number, message in enumerate(data["messages"], start=1):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise TurnRejected(f'Message {number}: expected {{"role": ..., "content": "text"}}.')
        role = message.get("role")
        if role == "system" and not messages:
            system.append(message["content"])
        elif role in ("user", "assistant"):
            messages.append(ImportedMessage(role=role, text=message["content"], sent_at=now))
        else:
            raise TurnRejected(f"Message {number}: the role must be system (first), user or assistant, not {role!r}.")
    if not messages:
        raise TurnRejected("The conversation has no user or assistant messages.")
    return ParsedImport(title=title, system_prompt="\n\n".join(system), messages=messages)
