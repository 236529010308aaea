"""A turn's life, in one place: its states, the moves allowed between them, and each move as one function
that locks the turn's row, checks the attempt, and defers its side effects to the commit.

    queued ──claim──▶ running ──finish──▶ done | cancelled
      │ ▲               │
      │ └───resend──────┤    a new attempt: its node died, stalled, was replaced or shut down
      ├─────fail────────┴──▶ failed ──retry──▶ queued (a new attempt)
      └─────cancel──────────▶ cancelled

Side effects wait for the commit (`transaction.on_commit`): the task is queued on its node, the stream's
fencing token moves to the new attempt (an older one can no longer write to it), and stream events carry
their attempt. Every write a node makes (claim, prompt, reply, failure) names its attempt; a stale one
changes nothing. Nothing else writes a turn. The claim and the prompt's record, on every first token's
path, are each one guarded UPDATE instead of a transaction (`turn_claim` says why that is the same).
"""

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from django.db import InterfaceError, OperationalError, connection, transaction
from django.utils import timezone
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from chatapp import metrics, quotas, streams
from chatapp.models import ApiKey, Conversation, Message, Turn
from chatapp.turns.events import end_event
from chatapp.validation import NoNodeUp, ReplyInProgress, TurnRejected
from router.services import NoHealthyNode, queue_for_node, session_node

if TYPE_CHECKING:
    from inference.types import Generation

logger = logging.getLogger(__name__)
Status = Turn.Status
DATABASE_RETRY_S = 60

ALLOWED: dict[str, set[str]] = {
    Status.QUEUED: {Status.RUNNING, Status.QUEUED, Status.FAILED, Status.CANCELLED},
    Status.RUNNING: {Status.DONE, Status.CANCELLED, Status.FAILED, Status.QUEUED},
    Status.FAILED: {Status.QUEUED},
    Status.DONE: set(),
    Status.CANCELLED: set(),
}


def _locked(turn_id: int, *, to: str, attempt: int | None = None) -> Turn | None:
    """The turn, locked for this transaction, if it may move to `to` and is still at `attempt` (None: any);
    else None (also once its conversation was deleted). Call inside `transaction.atomic()`."""
    locking = Turn.objects.select_for_update(of=("self",)).select_related("conversation")
    turn = locking.defer(*Turn.PROMPT_RECORD).filter(pk=turn_id).first()
    if turn is None:
        return None
    if attempt is not None and turn.attempt != attempt:
        return None
    return turn if to in ALLOWED[turn.status] else None


def _reconnecting[T](write: Callable[[], T]) -> T:
    """Run a node's transition, reconnecting and trying again while Postgres is unreachable (it restarts)
    for up to DATABASE_RETRY_S. Each transition checks its attempt under the row lock, so one that
    committed before its connection broke is a no-op the second time."""
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


def _ended(turn: Turn) -> None:
    """Once committed: the turn's end on its stream, and in the turns' count by final status."""
    status = turn.status
    _announce(turn, end_event(turn))
    transaction.on_commit(lambda: metrics.count("turns_total", status))


def _announce(turn: Turn, event: dict[str, Any]) -> None:
    attempt = turn.attempt
    transaction.on_commit(lambda: streams.publish_or_log(turn.stream_name, event, attempt=attempt))


def _dispatch(turn: Turn) -> None:
    """Queue the turn's task on its node. The turn is already stored: if the broker is unreachable, the
    node finds the turn by its age (`recovery.turns_reap`) once the broker is back."""
    from chatapp.tasks import generate

    try:
        generate.apply_async(args=(turn.pk, turn.attempt), queue=queue_for_node(turn.node))
    except (KombuError, RedisError, OSError) as exc:
        logger.warning("turn %s not queued yet (%s); its node will pick it up", turn.pk, exc)


def _queue(turn: Turn, *, node: str, why: str) -> None:
    """Make the locked turn a new attempt queued on `node`, keeping the one it ends in its attempt history;
    once committed, fence off older attempts and queue the task."""
    now = timezone.now()
    turn.earlier_attempts = [*turn.earlier_attempts, _attempt_record(turn, ended_at=now, why=why)]
    turn.node, turn.node_incarnation = node, ""
    turn.status, turn.error, turn.error_code = Status.QUEUED, "", ""
    turn.finished_at, turn.queued_at = None, now
    turn.attempt += 1
    fields = ["node", "node_incarnation", "status", "error", "error_code", "finished_at", "attempt", "queued_at"]
    fields.append("earlier_attempts")
    turn.save(update_fields=fields)
    attempt = turn.attempt

    def side_effects() -> None:
        try:
            streams.fence(turn.stream_name, attempt)
        except RedisError as exc:  # the new attempt's own first event raises the fence as well
            logger.warning("turn %s: stream not fenced yet (%s)", turn.pk, exc)
        _dispatch(turn)

    transaction.on_commit(side_effects)


def _attempt_record(turn: Turn, *, ended_at, why: str) -> dict[str, Any]:
    """The turn's current attempt as its history keeps it."""
    return {
        "attempt": turn.attempt,
        "node": turn.node,
        "incarnation": turn.node_incarnation,
        "status": turn.status,
        "error": turn.error,
        "queued_at": turn.queued_at.isoformat(),
        "started_at": turn.started_at.isoformat() if turn.started_at else None,
        "ended_at": ended_at.isoformat(),
        "why": why,
    }


# The web: a new turn, retry, cancel -------------------------------------------------


def turn_create(
    *, conversation: Conversation, user_message: Message, node: str, sampling: dict, api_key: ApiKey | None
) -> Turn:
    """A queued turn answering `user_message` on `node`; its task is queued once it is committed.
    Call inside the transaction that stored the message (`admission.turn_start` does)."""
    turn = Turn.objects.create(
        conversation=conversation,
        user_message=user_message,
        node=node,
        model=conversation.model,
        strategy=conversation.strategy,
        strategy_options=conversation.strategy_options,
        sampling=sampling,
        api_key=api_key,
    )
    transaction.on_commit(lambda: _dispatch(turn))
    return turn


def turn_retry(*, turn: Turn) -> None:
    """Send a failed turn again, as a new attempt, if it is its conversation's latest turn and nothing else
    is being written there; its user message stays as it was."""
    with transaction.atomic():
        Conversation.objects.select_for_update().get(pk=turn.conversation_id)  # one reply at a time
        locked = _locked(turn.pk, to=Status.QUEUED)
        if locked is None or locked.status != Status.FAILED:
            raise TurnRejected("Only a failed reply can be retried.")
        later = Turn.objects.filter(conversation_id=turn.conversation_id, pk__gt=turn.pk)
        if later.exclude(status__in=Turn.FINISHED).exists():
            raise ReplyInProgress("A later reply is still being written; wait for it or stop it first.")
        if later.exists():
            raise TurnRejected("Only the conversation's latest reply can be retried.")
        try:
            node = session_node(session_key=locked.conversation.session_key, model=locked.model)
        except NoHealthyNode as exc:
            raise NoNodeUp(str(exc)) from exc
        _queue(locked, node=node.name, why="retried")


def turn_cancel(*, turn: Turn) -> None:
    """Stop the turn: a queued one is cancelled at once; a running one stops at its next token, and the
    node keeps the partial reply."""
    with transaction.atomic():
        locked = _locked(turn.pk, to=Status.CANCELLED)
        if locked is not None and locked.status == Status.QUEUED:
            locked.status, locked.finish_reason, locked.finished_at = Status.CANCELLED, "cancelled", timezone.now()
            locked.save(update_fields=["status", "finish_reason", "finished_at"])
            _ended(locked)
            return
    if locked is not None:
        streams.request_cancel(turn.stream_name)


# Recovery: a new attempt, or a clear failure ---------------------------------------


def turn_resend(
    *, turn_id: int, attempt: int, why: str, still: Callable[[Turn], bool] = lambda turn: True
) -> bool | None:
    """Route an unfinished turn again and queue it as a new attempt (`why` goes in its attempt history), if
    it is still at `attempt` and `still` holds under its row lock: True if sent, None if stale (finished,
    moved on, or `still` fails), False if no node is up to take it."""
    with transaction.atomic():
        turn = _locked(turn_id, to=Status.QUEUED, attempt=attempt)
        if turn is None or turn.status == Status.FAILED or not still(turn):
            return None
        try:
            node = session_node(session_key=turn.conversation.session_key, model=turn.model)
        except NoHealthyNode:
            return False
        _queue(turn, node=node.name, why=why)
    return True


def turn_fail(*, turn_id: int, attempt: int, error: str, code: str = "generation_failed") -> bool:
    """Mark the turn failed, with an error for its reader, if it is still unfinished at `attempt`."""

    def fail() -> bool:
        with transaction.atomic():
            turn = _locked(turn_id, to=Status.FAILED, attempt=attempt)
            if turn is None:
                return False
            turn.status, turn.error, turn.error_code = Status.FAILED, error[:2000], code
            turn.finished_at = timezone.now()
            turn.save(update_fields=["status", "error", "error_code", "finished_at"])
            _ended(turn)
        return True

    return _reconnecting(fail)


# The node: claim, record the prompt, finish ----------------------------------------


def turn_claim(*, turn_id: int, attempt: int, node: str, incarnation: str) -> Turn | None:
    """Start running the turn on this node process, if it is queued at `attempt`; None otherwise (finished,
    or sent again since this task was queued). Announces the attempt's start on the stream.

    The node's writes run before every first token, so each is one guarded UPDATE, not a transaction
    around a locked read: Postgres locks the row and checks the attempt and status against its latest
    version, and the fields read before it never change while the turn stays queued at that attempt."""

    def claim() -> Turn | None:
        queued = Turn.objects.filter(pk=turn_id, attempt=attempt, status=Status.QUEUED)
        turn = queued.select_related("conversation").defer(*Turn.PROMPT_RECORD).first()
        if turn is None:
            return None
        turn.status, turn.node, turn.node_incarnation = Status.RUNNING, node, incarnation
        turn.started_at = timezone.now()
        turn.queue_ms = (turn.started_at - turn.created_at).total_seconds() * 1000
        moved = ("status", "node", "node_incarnation", "started_at", "queue_ms")
        if not queued.update(**{name: getattr(turn, name) for name in moved}):
            return None  # cancelled or sent again since it was read
        streams.publish_or_log(turn.stream_name, {"type": "start", "node": node}, attempt=attempt)
        return turn

    return _reconnecting(claim)


def turn_record_prompt(*, turn: Turn, fields: dict[str, Any]) -> bool:
    """Store what the running attempt's strategy resent and dropped; False if the attempt is stale (one
    guarded UPDATE, as `turn_claim`)."""

    def record() -> bool:
        return bool(Turn.objects.filter(pk=turn.pk, attempt=turn.attempt, status=Status.RUNNING).update(**fields))

    if not _reconnecting(record):
        return False
    for name, value in fields.items():
        setattr(turn, name, value)
    return True


def turn_finish(*, turn: Turn, generation: "Generation") -> Turn | None:
    """Store the running attempt's reply and measurements and announce its end; None if the attempt is
    stale or the turn already finished (nothing stored, nothing streamed).

    One guarded UPDATE, as `turn_claim`: the reply's message is inserted first and rolled back with the
    transaction when the turn is no longer running at this attempt (cancelled, sent again, deleted)."""

    def finish() -> Turn | None:
        with transaction.atomic():
            reply = None
            if generation.token_ids:  # a reply stopped before its first token leaves no message
                reply = Message.objects.create(
                    conversation_id=turn.conversation_id,
                    role=Message.Role.ASSISTANT,
                    content=generation.text,
                    token_ids=generation.token_ids,
                    model=turn.model,
                )
            cancelled = generation.finish_reason == "cancelled"
            fields = {
                "assistant_message": reply,
                "status": Status.CANCELLED if cancelled else Status.DONE,
                "finish_reason": generation.finish_reason,
                "prompt_tokens": generation.prompt_tokens,
                "cached_tokens": generation.cached_tokens,
                "cache_source": generation.cache_source,
                "queue_ms": (turn.queue_ms or 0) + generation.queue_ms,
                "completion_tokens": len(generation.token_ids),
                "prefill_ms": generation.prefill_ms,
                "ttft_ms": generation.ttft_ms,
                "decode_tokens_per_s": generation.decode_tokens_per_s,
                "finished_at": timezone.now(),
            }
            running = Turn.objects.filter(pk=turn.pk, attempt=turn.attempt, status=Status.RUNNING)
            if not running.update(**fields):
                transaction.set_rollback(True)
                return None
            for name, value in fields.items():
                setattr(turn, name, value)
            _ended(turn)
            used = generation.prompt_tokens + len(generation.token_ids)
            owner, key = turn.conversation.owner_id, turn.api_key_id
            transaction.on_commit(lambda: quotas.charge_tokens(user_id=owner, api_key_id=key, tokens=used))
        return turn

    return _reconnecting(finish)
