"""Summaries of the turns a prompt dropped: which to write (planned from stored state, pure), written after
a reply so they never delay a first token, in chunks that always fit the model's context.

A strategy with `summarize` only reads the summaries stored so far; it never asks for one. After each
turn, `summary_jobs` plans what is still unsummarised before the prompt's verbatim window: transcripts of
at most CHUNK_TOKENS each. Once the current summaries pass ROLLUP_TOKENS together, they are folded into
one (a roll-up, covering all of theirs), so the summary segment stays bounded however long the
conversation grows; each summarising prompt is at most CHUNK_TOKENS plus an instruction.
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from chatapp.memory.base import StoredMessage, StoredSummary, current_summaries

if TYPE_CHECKING:
    from inference.chat_format import ChatFormat

CHUNK_TOKENS = 1024
SUMMARY_TOKENS = 96
ROLLUP_TOKENS = 384
SUMMARY_INSTRUCTION = (
    "Summarize the conversation below in two or three sentences. Keep every name, place, date, number and fact.\n\n"
)


@dataclass(frozen=True)
class SummaryJob:
    """One summarising prompt's text, and the range of messages its summary will cover."""

    transcript: str
    first_message_id: int
    through_message_id: int


def summary_jobs(
    *,
    history: Sequence[StoredMessage],
    window_start: int,
    summaries: Sequence[StoredSummary],
    count_text: Callable[[str], int],
    names: Mapping[str, str] | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> list[SummaryJob]:
    """Chunks of at most `chunk_tokens` of the messages before the prompt's verbatim window (its first
    message's id, `window_start`) that no summary covers yet, oldest first."""
    names = names or {"user": "User", "assistant": "Assistant"}
    covered = max((s.through_message_id for s in current_summaries(summaries)), default=0)
    pending = [m for m in history if covered < m.id < window_start and not m.excluded and not m.pinned]
    jobs: list[SummaryJob] = []
    lines: list[str] = []
    first = last = used = 0
    for message in pending:
        line = f"{names.get(message.role, message.role)}: {message.text}"
        cost = count_text(line + "\n")  # with the newline that joins it to the next
        if lines and used + cost > chunk_tokens:
            jobs.append(SummaryJob("\n".join(lines), first, last))
            lines, used = [], 0
        if not lines:
            first = message.id
        lines.append(line if cost <= chunk_tokens else _cut(line, chunk_tokens, count_text))
        used += min(cost, chunk_tokens)
        last = message.id
    if lines:
        jobs.append(SummaryJob("\n".join(lines), first, last))
    return jobs


def rollup_job(
    summaries: Sequence[StoredSummary], count_text: Callable[[str], int], chunk_tokens: int = CHUNK_TOKENS
) -> SummaryJob | None:
    """Fold the current summaries into one once together they pass ROLLUP_TOKENS."""
    current = current_summaries(summaries)
    if len(current) < 2 or sum(count_text(s.text) for s in current) <= ROLLUP_TOKENS:
        return None
    text = _cut("\n".join(s.text for s in current), chunk_tokens, count_text)
    return SummaryJob(text, current[0].first_message_id, current[-1].through_message_id)


def summaries_bring_up_to_date(
    *,
    history: Sequence[StoredMessage],
    window_start: int,
    summaries: Sequence[StoredSummary],
    count_text: Callable[[str], int],
    write: Callable[[SummaryJob], StoredSummary],
    names: Mapping[str, str] | None = None,
    chunk_tokens: int = CHUNK_TOKENS,
) -> list[StoredSummary]:
    """Have `write` (the model, or a stand-in) do every job due before `window_start`; all summaries after."""
    summaries = list(summaries)
    jobs = summary_jobs(
        history=history,
        window_start=window_start,
        summaries=summaries,
        count_text=count_text,
        names=names,
        chunk_tokens=chunk_tokens,
    )
    for job in jobs:
        summaries.append(write(job))
        if rollup := rollup_job(summaries, count_text, chunk_tokens):
            summaries.append(write(rollup))
    return summaries


def _cut(text: str, tokens: int, count_text: Callable[[str], int]) -> str:
    """A prefix of `text` within `tokens` (cut by a quarter at a time)."""
    while count_text(text) > tokens:
        text = text[: len(text) * 3 // 4]
    return text


def stand_in_writer(fmt: "ChatFormat") -> Callable[[SummaryJob], StoredSummary]:
    """For runs without a model (dry replays, bench_memory): each summary is the first SUMMARY_TOKENS tokens
    of what it would summarise, so its size, and where it sits, are right."""

    def write(job: SummaryJob) -> StoredSummary:
        text = fmt.display(fmt.text_tokens(job.transcript)[:SUMMARY_TOKENS])
        return StoredSummary(text, job.through_message_id, job.first_message_id)

    return write
