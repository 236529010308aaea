"""Nothing stuck: turns whose node process is gone are sent again, or failed with a clear error.

A turn is orphaned when the node process that holds it is no longer there:
- its node is down or unresponsive (missed heartbeats; a clean shutdown marks it down);
- its node restarted under the same name: the turn was claimed by an earlier incarnation;
- it has been queued on an idle node for longer than CHAT_LOST_TURN_SECONDS (its task was lost with a
  broker that restarted, or the broker was down when the turn was stored).

`turns_reap` sends orphans again, as new attempts, to a healthy node; while no node is up it keeps
trying, and fails a turn once it has waited CHAT_ORPHAN_SECONDS without a node. Every node runs it on
its heartbeat, a node runs `turns_take_back` when it starts and `turns_hand_off` when it stops, and a
web process runs it for a turn a reader waits on, so even a cluster whose only node died ends its turns.
"""

import logging
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F, OuterRef, Q, QuerySet, Subquery
from django.utils import timezone

from chatapp.models import Turn
from chatapp.turns.lifecycle import turn_fail, turn_resend
from router.models import Node
from router.services import nodes_reap

logger = logging.getLogger(__name__)
SERVING = (Node.Status.UP, Node.Status.DRAINING)


def _unfinished() -> QuerySet[Turn]:
    return Turn.objects.exclude(status__in=Turn.FINISHED)


def _orphans(turns: QuerySet[Turn]) -> QuerySet[Turn]:
    """The turns whose node process is gone: its node is not serving, or it is another incarnation now."""
    node = Node.objects.filter(name=OuterRef("node"))
    serving = node.filter(status__in=SERVING)
    turns = turns.annotate(
        serving_incarnation=Subquery(serving.values("incarnation")[:1]),
        node_heard_at=Subquery(node.values("last_heartbeat")[:1]),
    )
    # Claimed by another process under the node's name (blank: claimed before incarnations were kept).
    replaced = Q(status=Turn.Status.RUNNING) & ~Q(node_incarnation="") & ~Q(node_incarnation=F("serving_incarnation"))
    return turns.filter(Q(serving_incarnation__isnull=True) | replaced)


def turns_reap(*, turn_id: int | None = None) -> int:
    """Mark down the nodes that missed their heartbeats, then send each orphaned turn (or only `turn_id`)
    again, or fail it once it has waited CHAT_ORPHAN_SECONDS with no node up; the number handled."""
    nodes_reap()
    turns = _unfinished() if turn_id is None else _unfinished().filter(pk=turn_id)
    handled = 0
    for turn in _orphans(turns).only("pk", "attempt", "queued_at", "node"):
        heard_at = turn.node_heard_at  # type: ignore[attr-defined]
        since = max(filter(None, [turn.queued_at, heard_at]))
        replaced = turn.serving_incarnation is not None  # type: ignore[attr-defined]
        why = f"node {turn.node} " + ("restarted" if replaced else "went down or stopped answering")
        handled += _send_again_or_fail(turn, since=since, why=why)
    return handled


def turns_resend_lost(*, node: str) -> int:
    """Send again the turns queued on idle `node` for longer than CHAT_LOST_TURN_SECONDS: their task is gone.
    A late original task for an older attempt does nothing. Call only while the node runs nothing."""
    cutoff = timezone.now() - timedelta(seconds=settings.CHAT_LOST_TURN_SECONDS)
    lost = _unfinished().filter(node=node, status=Turn.Status.QUEUED, queued_at__lt=cutoff)
    return sum(
        bool(
            turn_resend(
                turn_id=t.pk, attempt=t.attempt, why="its task was lost", still=lambda turn: turn.queued_at < cutoff
            )
        )
        for t in lost
    )


def turns_take_back(*, node: str) -> int:
    """At a node's start, before it consumes: send again what earlier processes under its name left
    unfinished (their tasks died with them, or were acknowledged and lost). Sticky routing usually brings
    them back to this node, each as a new attempt."""
    left = _unfinished().filter(node=node).only("pk", "attempt", "queued_at")
    why = f"node {node} restarted"
    return sum(_send_again_or_fail(turn, since=turn.queued_at, why=why) for turn in left)


def turns_hand_off(*, node: str) -> int:
    """At a clean shutdown, once the node is marked down and its running turns are done: send its queued
    turns to other nodes, or fail them clearly when there is none."""
    handed = 0
    for turn in _unfinished().filter(node=node).only("pk", "attempt"):
        sent = turn_resend(turn_id=turn.pk, attempt=turn.attempt, why=f"node {node} shut down")
        if sent is False:
            sent = turn_fail(
                turn_id=turn.pk,
                attempt=turn.attempt,
                error=f"Node {node} shut down and no other node is up to write this reply; retry it later.",
                code="no_node",
            )
        handed += bool(sent)
    return handed


def _send_again_or_fail(turn: Turn, *, since: datetime, why: str) -> int:
    sent = turn_resend(turn_id=turn.pk, attempt=turn.attempt, why=why)
    if sent is not False:
        if sent:
            logger.warning("turn %s: node %s is gone; sent again as attempt %d", turn.pk, turn.node, turn.attempt + 1)
        return int(bool(sent))
    waited = (timezone.now() - since).total_seconds()
    if waited < settings.CHAT_ORPHAN_SECONDS:
        return 0
    return int(
        turn_fail(
            turn_id=turn.pk,
            attempt=turn.attempt,
            error=f"No inference node has been up for {waited:.0f} s to write this reply; retry it later.",
            code="no_node",
        )
    )
