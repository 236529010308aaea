"""Real multi-turn conversations for replays and benchmarks, from the `chitchat-dataset` package (MIT)."""

from collections.abc import Iterator
from functools import cache


@cache
def _chitchat() -> dict:
    import chitchat_dataset

    return chitchat_dataset.Dataset()


def chitchat_conversations(*, min_messages: int = 2) -> Iterator[list[str]]:
    """Each conversation as its messages in order (one speaker's consecutive lines joined), speakers alternating."""
    for conversation in _chitchat().values():
        messages = [" ".join(u["text"].strip() for u in message).strip() for message in conversation["messages"]]
        messages = [m for m in messages if m]
        if len(messages) >= min_messages:
            yield messages
