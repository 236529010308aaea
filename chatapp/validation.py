"""What a person may send, checked before anything is stored, and the refusals that say why."""

import re

from django.conf import settings

# C0 control characters other than tab, newline and carriage return; Postgres rejects NUL outright.
_CONTROL_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


class TurnRejected(ValueError):
    """A message that will not be sent (or a write that will not be made); the text says why, for the
    person who sent it. Nothing was stored. `status` is the HTTP status that answers it."""

    status = 400
    retry_after: int | None = None


class ReplyInProgress(TurnRejected):
    """The conversation already has a reply being written."""

    status = 409


class NodeBusy(TurnRejected):
    """The session's node has a full queue: try again in `retry_after` seconds."""

    status = 429
    retry_after = 2


class QuotaExceeded(TurnRejected):
    """The user (or API key) is over a fair-use limit: try again in `retry_after` seconds."""

    status = 429

    def __init__(self, message: str, *, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NoNodeUp(TurnRejected):
    """No inference node is healthy (all restarting, say): try again in `retry_after` seconds."""

    status = 503
    retry_after = 5


class ContextTooSmall(TurnRejected):
    """The message alone, with room for a reply, does not fit the model's context."""


def without_control_characters(text: str) -> str:
    """The text with C0 controls (but tab and newlines) removed and unencodable characters replaced."""
    return _CONTROL_CHARS.sub("", text.encode("utf-8", errors="replace").decode("utf-8"))


def control_character_in(text: str) -> str | None:
    """The first control character (other than tab and newlines) in the text, as U+XXXX, or None."""
    found = _CONTROL_CHARS.search(text)
    return f"U+{ord(found.group()):04X}" if found else None


def check_message_text(text: str) -> str:
    """Return the text as it will be stored, or raise `TurnRejected` saying what is wrong with it."""
    text = without_control_characters(text).strip()
    if not text:
        raise TurnRejected("The message is empty.")
    limit = settings.CHAT_MAX_MESSAGE_CHARS
    if len(text) > limit:
        raise TurnRejected(f"The message is {len(text):,} characters; the limit is {limit:,}.")
    return text
