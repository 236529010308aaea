"""The node side of a turn, and the one bridge between chatapp and inference: claim, assemble, generate,
finish. Every write goes through `chatapp.turns.lifecycle`, under the attempt this task was queued for."""

import dataclasses
import logging
import threading
from typing import TYPE_CHECKING

from chatapp import stream_writer, streams
from chatapp.memory.assembly import prompt_record, turn_prompt, turn_summarize
from chatapp.memory.base import ContextOverflow
from chatapp.models import Turn
from chatapp.turns.lifecycle import turn_claim, turn_fail, turn_finish, turn_record_prompt
from inference.types import PromptTooLong

if TYPE_CHECKING:
    from inference.engine import Engine
    from inference.types import Sampling

logger = logging.getLogger(__name__)


def turn_generate(*, turn_id: int, attempt: int, engine: "Engine", node: str, incarnation: str) -> None:
    """Run one attempt of a turn on this node's engine and store its reply, at most once. A turn already
    finished or sent again since this task was queued is left alone; one sent again while it runs stops
    at its next token and stores nothing."""
    turn = turn_claim(turn_id=turn_id, attempt=attempt, node=node, incarnation=incarnation)
    if turn is None:
        return
    if turn.model != engine.model:  # routed by model, so only a node replaced by another model's gets here
        turn_fail(turn_id=turn.pk, attempt=attempt, error=f"This node serves {engine.model}, not {turn.model}.")
        return
    sampling = turn_sampling(turn, engine.default_sampling())
    tokens = _TokenStream(turn)
    try:
        prompt = turn_prompt(turn=turn, engine=engine, sampling=sampling)
        if not turn_record_prompt(turn=turn, fields=prompt_record(turn, prompt, engine.chat_format)):
            return
        try:
            generation = engine.generate(
                session_key=turn.conversation.session_key,
                prompt=prompt.tokens,
                sampling=sampling,
                on_text=tokens.publish,
                stop=tokens.watched(),
            )
        finally:
            tokens.wait_written()
    except (PromptTooLong, ContextOverflow) as exc:
        turn_fail(
            turn_id=turn.pk, attempt=attempt, error=f"{type(exc).__name__}: {exc}", code="context_length_exceeded"
        )
        return
    except Exception as exc:
        logger.exception("turn %s failed on node %s", turn_id, node)
        turn_fail(turn_id=turn.pk, attempt=attempt, error=f"{type(exc).__name__}: {exc}")
        return
    finished = turn_finish(turn=turn, generation=generation)
    if finished is not None and finished.status == Turn.Status.DONE:
        _summarize_after(turn=turn, engine=engine)


class _TokenStream:
    """The attempt's tokens onto its stream (through the node's `stream_writer`, batched with the other
    replies' tokens), until a later attempt owns the stream or a reader asks the turn to stop.

    The node's stream writer tells the engine to stop the attempt (`Appends.stopped`): from an append's
    answer while tokens flow, and, before the first token or in a pause, from its own read of the turn's
    cancel flag, with the other replies' text. No thread of the turn's polls Redis, or wakes to poll."""

    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.appends = stream_writer.Appends(turn.stream_name, turn.attempt)

    def watched(self) -> threading.Event:
        """The event the engine ends the attempt on, watched by the writer from now until `wait_written`."""
        stream_writer.writer().watch(self.appends)
        return self.appends.stopped

    def publish(self, text: str) -> bool:
        """On the engine thread: queue the text for the stream; False once the attempt must end."""
        if self.appends.answer is not streams.Appended.SUPERSEDED:
            stream_writer.writer().append(self.appends, text)
        return not self.appends.stopped.is_set()

    def wait_written(self) -> None:
        """Stop watching; send the tokens still queued, and wait until they are on the stream, so that the
        turn's end (or error) event comes after them."""
        stream_writer.writer().unwatch(self.appends)
        if not stream_writer.writer().flush(self.appends):
            logger.warning("turn %s: tokens still not streamed after %ss", self.turn.pk, stream_writer.FLUSH_TIMEOUT_S)


def _summarize_after(*, turn: Turn, engine: "Engine") -> None:
    """Write the summaries the turn's prompt now needs, after its reply is stored and streamed: a summary
    never delays a first token, and a failed one only leaves the next prompt without it."""
    try:
        turn_summarize(turn=turn, engine=engine)
    except Exception:
        logger.exception("summarising after turn %s failed", turn.pk)


def turn_sampling(turn: Turn, defaults: "Sampling") -> "Sampling":
    """The node's defaults with whatever this turn asked for (an API request's parameters)."""
    asked = dict(turn.sampling)
    if "stop" in asked:
        asked["stop"] = tuple(asked["stop"])
    return dataclasses.replace(defaults, **asked)
