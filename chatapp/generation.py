"""The node side of a turn, and the one bridge between chatapp and inference: claim the turn, assemble
its prompt with the conversation's memory strategy, generate on this node's engine, store the reply."""

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from django.db import InterfaceError, OperationalError, connection, transaction
from django.utils import timezone

from chatapp import streams
from chatapp.memory.assembly import turn_prompt, turn_record_prompt, turn_summarize
from chatapp.memory.base import ContextOverflow
from chatapp.models import Message, Turn
from chatapp.services import session_key_for
from chatapp.turn_events import end_event
from inference.engine import PromptTooLong

if TYPE_CHECKING:
    from inference.engine import Engine, Generation, Sampling

logger = logging.getLogger(__name__)
DATABASE_RETRY_S = 60


def turn_generate(*, turn_id: int, attempt: int, engine: "Engine", node: str) -> None:
    """Run one turn on this node's engine and store its reply; idempotent by turn id.

    A turn already finished, or sent again since this task was queued, is left
    alone, and the reply is stored at most once.
    """
    turn = _turn_claim(turn_id=turn_id, attempt=attempt, node=node)
    if turn is None:
        return
    sampling = turn_sampling(turn, engine.default_sampling())
    try:
        prompt = turn_prompt(turn=turn, engine=engine, sampling=sampling)
        turn_record_prompt(turn=turn, prompt=prompt, detokenize=engine.chat_format.display)
        generation = engine.generate(
            session_key=session_key_for(turn.conversation),
            prompt=prompt.tokens,
            sampling=sampling,
            on_text=lambda text: _stream_token(turn, text),
            should_stop=lambda: streams.cancel_requested(turn.stream_name),
        )
    except (PromptTooLong, ContextOverflow) as exc:
        _turn_fail(turn=turn, error=f"{type(exc).__name__}: {exc}", code="context_length_exceeded")
        return
    except Exception as exc:
        logger.exception("turn %s failed on node %s", turn_id, node)
        _turn_fail(turn=turn, error=f"{type(exc).__name__}: {exc}")
        return
    if _turn_finish(turn=turn, generation=generation):
        _summarize_after(turn=turn, engine=engine)


def _summarize_after(*, turn: Turn, engine: "Engine") -> None:
    """Write the summaries the turn's prompt now needs, after its reply is stored and streamed: a summary
    never delays a first token, and a failed one only leaves the next prompt without it."""
    try:
        turn_summarize(turn=turn, engine=engine)
    except Exception:
        logger.exception("summarising after turn %s failed", turn.pk)


def _stream_token(turn: Turn, text: str) -> None:
    streams.publish_or_log(turn.stream_name, {"type": "token", "text": text})


def turn_sampling(turn: Turn, defaults: "Sampling") -> "Sampling":
    """The node's defaults with whatever this turn asked for (an API request's parameters)."""
    asked = dict(turn.sampling)
    if "stop" in asked:
        asked["stop"] = tuple(asked["stop"])
    return dataclasses.replace(defaults, **asked)


def _reconnecting[T](write: Callable[[], T]) -> T:
    """Run a database step, reconnecting and trying again while Postgres is unreachable (it restarts) for up
    to DATABASE_RETRY_S; each step is idempotent, so one that committed before its connection broke is a no-op."""
    deadline = time.monotonic() + DATABASE_RETRY_S
    while True:
        try:
            return write()
        except (OperationalError, InterfaceError) as exc:
            if time.monotonic() > deadline:
                raise
            logger.warning("database unreachable (%s); trying again", str(exc).strip().splitlines()[0])
            connection.close()
            time.sleep(1)


def _turn_claim(*, turn_id: int, attempt: int, node: str) -> Turn | None:
    turn = _reconnecting(lambda: _claim(turn_id=turn_id, attempt=attempt, node=node))
    if turn is not None:
        streams.publish_or_log(turn.stream_name, {"type": "start", "node": node, "attempt": attempt})
    return turn


def _claim(*, turn_id: int, attempt: int, node: str) -> Turn | None:
    with transaction.atomic():
        turn = Turn.objects.select_for_update().select_related("conversation").get(pk=turn_id)
        if turn.is_finished or turn.attempt != attempt:
            return None
        turn.status = Turn.Status.RUNNING
        turn.node = node
        turn.started_at = timezone.now()
        turn.queue_ms = (turn.started_at - turn.created_at).total_seconds() * 1000
        turn.save(update_fields=["status", "node", "started_at", "queue_ms"])
    return turn


_FINISH_FIELDS = ["assistant_message", "status", "finish_reason", *Turn.MEASUREMENTS, "finished_at"]


def _turn_finish(*, turn: Turn, generation: "Generation") -> bool:
    """Store and announce the reply; False when the turn was already finished (nothing stored)."""
    stored = _reconnecting(lambda: _store_reply(turn=turn, generation=generation))
    if stored is not None:
        streams.publish_or_log(turn.stream_name, end_event(stored))
    return stored is not None and stored.status == Turn.Status.DONE


def _store_reply(*, turn: Turn, generation: "Generation") -> Turn | None:
    """Store the reply and the turn's measurements, once: a turn already finished is left as it is (None)."""
    with transaction.atomic():
        locked = Turn.objects.select_for_update().get(pk=turn.pk)
        if locked.is_finished:
            return None
        reply = None
        if generation.token_ids:  # a reply stopped before its first token leaves no message
            reply = Message.objects.create(
                conversation_id=turn.conversation_id,
                role=Message.Role.ASSISTANT,
                content=generation.text,
                token_ids=generation.token_ids,
            )
        locked.assistant_message = reply
        locked.status = Turn.Status.CANCELLED if generation.finish_reason == "cancelled" else Turn.Status.DONE
        locked.finish_reason = generation.finish_reason
        locked.prompt_tokens = generation.prompt_tokens
        locked.cached_tokens = generation.cached_tokens
        locked.restored_from_ram = generation.restored
        locked.queue_ms = (locked.queue_ms or 0) + generation.queue_ms
        locked.completion_tokens = len(generation.token_ids)
        locked.prefill_ms = generation.prefill_ms
        locked.ttft_ms = generation.ttft_ms
        locked.decode_tokens_per_s = generation.decode_tokens_per_s
        locked.finished_at = timezone.now()
        locked.save(update_fields=_FINISH_FIELDS)
    return locked


def _turn_fail(*, turn: Turn, error: str, code: str = "generation_failed") -> None:
    _reconnecting(
        lambda: (
            Turn.objects.filter(pk=turn.pk)
            .exclude(status__in=Turn.FINISHED)
            .update(status=Turn.Status.FAILED, error=error[:2000], finished_at=timezone.now())
        )
    )
    streams.publish_or_log(turn.stream_name, {"type": "error", "error": error[:2000], "code": code})
