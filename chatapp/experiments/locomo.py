"""LoCoMo (Maharana et al., ACL 2024) as a source: long conversations, and questions tied to the turns that
hold their answers. The data is CC BY-NC and is read from where it lies (default: ../shared/data/locomo/),
never copied into this repository.

Speaker A is the user and speaker B the assistant. Every turn keeps its session's date-time (the turns
of a session are a second apart, in order), and a shared photo's caption is part of its turn's text.
"""

import json
import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from django.conf import settings

from chatapp.experiments.sources import SourceError

DEFAULT_FILE = settings.BASE_DIR.parent / "shared" / "data" / "locomo" / "locomo8.json"
CATEGORIES = {1: "multi-hop", 2: "temporal", 3: "open-domain", 4: "single-hop", 5: "adversarial"}
_EVIDENCE = re.compile(r"D:?(\d+):0*(\d+)")


@dataclass(frozen=True)
class LocomoTurn:
    dia_id: str  # "D3:7": session 3, turn 7
    speaker: str
    text: str
    session: int
    when: datetime


@dataclass(frozen=True)
class LocomoQuestion:
    text: str
    answer: str
    evidence: tuple[str, ...]  # dia_ids of the turns that hold the answer
    category: int


@dataclass(frozen=True)
class LocomoConversation:
    sample_id: str
    speaker_a: str  # the user
    speaker_b: str  # the assistant
    turns: tuple[LocomoTurn, ...]
    questions: tuple[LocomoQuestion, ...]


def parse_when(text: str) -> datetime:
    """LoCoMo's session date-times, such as "1:56 pm on 8 May, 2023", as UTC."""
    return datetime.strptime(text.strip(), "%I:%M %p on %d %B, %Y").replace(tzinfo=UTC)


def evidence_ids(raw: str) -> list[str]:
    """The dia_ids in one evidence entry. A few entries hold several ids ("D8:6; D9:17") or are misspelt
    ("D:11:26", "D30:05"); those are read as the ids they name."""
    return [f"D{int(session)}:{int(turn)}" for session, turn in _EVIDENCE.findall(raw)]


def locomo_read(path: Path) -> list[LocomoConversation]:
    """Every conversation in a LoCoMo file (the format of its locomo10.json)."""
    try:
        records = json.loads(Path(path).read_text(encoding="utf-8"))
        return [_conversation(record) for record in records]
    except FileNotFoundError as exc:
        raise SourceError(f"{path}: no such file (LoCoMo is read from ../shared/data/locomo/ or --file).") from exc
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise SourceError(f"{path}: not a LoCoMo file ({type(exc).__name__}: {exc}).") from exc


def _conversation(record: dict) -> LocomoConversation:
    conversation = record["conversation"]
    turns: list[LocomoTurn] = []
    session = 1
    while f"session_{session}" in conversation:
        started = parse_when(conversation[f"session_{session}_date_time"])
        for index, turn in enumerate(conversation[f"session_{session}"]):
            text = str(turn["text"])
            if turn.get("blip_caption"):
                text = f"{text} [shares a photo: {turn['blip_caption']}]"
            when = started + timedelta(seconds=index)
            turns.append(LocomoTurn(str(turn["dia_id"]), str(turn["speaker"]), text, session, when))
        session += 1
    questions = tuple(
        LocomoQuestion(
            text=str(qa["question"]),
            answer=str(qa.get("answer", qa.get("adversarial_answer", ""))),
            evidence=tuple(i for raw in qa.get("evidence", []) for i in evidence_ids(str(raw))),
            category=int(qa["category"]),
        )
        for qa in record["qa"]
    )
    if not turns:
        raise ValueError(f"conversation {record.get('sample_id')!r} has no sessions")
    return LocomoConversation(
        str(record["sample_id"]), conversation["speaker_a"], conversation["speaker_b"], tuple(turns), questions
    )
