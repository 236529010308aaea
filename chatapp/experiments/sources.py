"""Where a replay's sessions come from: the chitchat dataset, JSONL files of OpenAI-style messages, and
planted-fact probe sets (JSONL too, written by `make_probes`)."""

import json
import random
from dataclasses import dataclass
from pathlib import Path

from chatapp.datasets import chitchat_conversations


class SourceError(ValueError):
    """A source that cannot be replayed; the text says where and why."""


@dataclass(frozen=True)
class Probe:
    """A fact planted in the session's first message and asked for in its last."""

    answer: str
    distance: int  # exchanges between the fact and the question


@dataclass(frozen=True)
class ReplaySession:
    key: str
    user_messages: tuple[str, ...]
    # The recorded other side, one per user message ("" where none): a dry run's stand-in for the model.
    replies: tuple[str, ...]
    probe: Probe | None = None

    def first(self, turns: int | None) -> "ReplaySession":
        """The session cut to its first `turns` turns (a probe keeps its question, which is the last turn)."""
        if turns is None or turns >= len(self.user_messages) or self.probe:
            return self
        return ReplaySession(self.key, self.user_messages[:turns], self.replies[:turns], self.probe)


def chitchat_sessions(*, count: int, turns: int | None, seed: int) -> list[ReplaySession]:
    """`count` conversations drawn at random (seeded), preferring those with at least `turns` turns."""
    conversations = list(chitchat_conversations(min_messages=2 * (turns or 1)))
    chosen = random.Random(seed).sample(range(len(conversations)), min(count, len(conversations)))  # noqa: S311
    sessions = []
    for index in chosen:
        messages = conversations[index]
        users, replies = tuple(messages[0::2]), tuple(messages[1::2])
        sessions.append(ReplaySession(f"chitchat:{index}", users, replies + ("",) * (len(users) - len(replies))))
    return [s.first(turns) for s in sessions]


def jsonl_sessions(path: Path, *, count: int | None = None, turns: int | None = None) -> list[ReplaySession]:
    """One session a line: `{"messages": [{"role": ..., "content": ...}, ...]}` (system messages are ignored;
    each assistant message is the recorded reply to the user message before it), with an optional `probe`."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SourceError(f"{path}: cannot read it ({exc}).") from exc
    sessions = []
    for number, line in enumerate(lines, start=1):
        if line.strip():
            sessions.append(_session_from_line(path, number, line).first(turns))
    if not sessions:
        raise SourceError(f"{path}: no sessions in it.")
    return sessions[:count] if count else sessions


def _session_from_line(path: Path, number: int, line: str) -> ReplaySession:
    where = f"{path}, line {number}"
    try:
        record = json.loads(line)
        messages = record["messages"]
        users: list[str] = []
        replies: list[str] = []
        for message in messages:
            role, content = message["role"], message["content"]
            if not isinstance(content, str):
                raise TypeError("content must be a string")
            if role == "user":
                users.append(content)
                replies.append("")
            elif role == "assistant" and users:
                replies[-1] = content
        probe = Probe(str(record["probe"]["answer"]), int(record["probe"]["distance"])) if "probe" in record else None
    except (ValueError, KeyError, TypeError) as exc:
        raise SourceError(f'{where}: expected {{"messages": [{{"role", "content"}}, ...]}} ({exc!r}).') from exc
    if not users:
        raise SourceError(f"{where}: no user message.")
    return ReplaySession(str(record.get("id", f"{path.name}:{number}")), tuple(users), tuple(replies), probe)
