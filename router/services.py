"""Which node serves a session: the node registry and sticky, bounded-load assignment.

The router decides where, never how. Nodes register and heartbeat
themselves; one that misses heartbeats for ROUTER_NODE_TIMEOUT_SECONDS is no
longer healthy and is marked down by the next reaper pass.
"""

import hashlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q
from django.utils import timezone

from router import registry
from router.models import AssignmentMove, Node, SessionAssignment
from router.policies import NodeLoad, RoutingPolicy


class NoHealthyNode(RuntimeError):
    pass


def queue_for_node(name: str) -> str:
    return f"{settings.NODE_QUEUE_PREFIX}{name}"


def policy_get(alias: str | None = None) -> RoutingPolicy:
    return registry.build("ROUTER_POLICIES", alias or settings.ROUTER_DEFAULT_POLICY)


def prefix_routing_key(prefix: Sequence[int] | str) -> str:
    """A session key for a client that sends none: a hash of its conversation's first tokens or text
    (system prompt and first user message), so the same conversation keeps landing on the same node."""
    data = prefix.encode() if isinstance(prefix, str) else b",".join(str(t).encode() for t in prefix)
    return "prefix:" + hashlib.blake2b(data, digest_size=16).hexdigest()


# Registry -----------------------------------------------------------------------


def node_heartbeat(*, name: str, capacity: int, stats: dict[str, Any]) -> None:
    """Register the node (up, if new) or refresh its heartbeat and stats; a drained or downed node stays so."""
    now = timezone.now()
    Node.objects.update_or_create(
        name=name,
        defaults={"queue": queue_for_node(name), "capacity": capacity, "stats": stats, "last_heartbeat": now},
        create_defaults={
            "queue": queue_for_node(name),
            "capacity": capacity,
            "stats": stats,
            "last_heartbeat": now,
            "started_at": now,
            "status": Node.Status.UP,
        },
    )


def node_start(*, name: str, capacity: int) -> None:
    """A node (re)joining: up again whatever it was, with a fresh heartbeat."""
    node_heartbeat(name=name, capacity=capacity, stats={})
    Node.objects.filter(name=name).update(status=Node.Status.UP, started_at=timezone.now())


def node_set_status(*, name: str, status: Node.Status) -> None:
    Node.objects.filter(name=name).update(status=status)


def nodes_reap() -> list[str]:
    """Mark down the nodes whose heartbeat is older than the timeout; return their names."""
    with transaction.atomic():
        stale = list(
            Node.objects.select_for_update(skip_locked=True)
            .filter(_stale_q())
            .exclude(status=Node.Status.DOWN)
            .values_list("name", flat=True)
        )
        Node.objects.filter(name__in=stale).update(status=Node.Status.DOWN)
    return stale


def _heartbeat_cutoff():
    return timezone.now() - timedelta(seconds=settings.ROUTER_NODE_TIMEOUT_SECONDS)


def _stale_q() -> Q:
    return Q(last_heartbeat__lt=_heartbeat_cutoff()) | Q(last_heartbeat__isnull=True)


def is_healthy(node: Node) -> bool:
    """Up, and heard from within the timeout: it may take new sessions."""
    fresh = node.last_heartbeat is not None and node.last_heartbeat >= _heartbeat_cutoff()
    return node.status == Node.Status.UP and fresh


def healthy_nodes() -> list[Node]:
    return list(Node.objects.filter(status=Node.Status.UP).exclude(_stale_q()).order_by("name"))


# Assignment ---------------------------------------------------------------------


def session_node(*, session_key: str, policy: str | None = None) -> Node:
    """The node for this session's next turn: kept while healthy and not overloaded, else moved and recorded.

    Race-free: concurrent first turns of one session get the same node (the
    assignment row is unique per session and locked while deciding).
    """
    chooser = policy_get(policy)
    nodes = healthy_nodes()
    if not nodes:
        raise NoHealthyNode("No inference node is up; try again shortly.")
    by_name = {n.name: n for n in nodes}
    loads = [NodeLoad(n.name, n.sessions) for n in nodes]
    locked = SessionAssignment.objects.select_for_update(of=("self",)).select_related("node")
    with transaction.atomic():
        assignment = locked.filter(session_key=session_key).first()
        if assignment is None:
            choice = chooser.choose(session_key=session_key, current=None, nodes=loads)
            assignment, created = SessionAssignment.objects.get_or_create(
                session_key=session_key, defaults={"node": by_name[choice.node], "reason": choice.reason}
            )
            if created:
                Node.objects.filter(name=choice.node).update(sessions=F("sessions") + 1)
                return by_name[choice.node]
            assignment = locked.get(pk=assignment.pk)  # another request placed it first: use its choice
        current = assignment.node.name if assignment.node.name in by_name else None
        choice = chooser.choose(session_key=session_key, current=current, nodes=loads)
        if choice.node != assignment.node.name:
            _move(assignment, by_name[choice.node], choice.reason if current else "node down or draining")
        return by_name[choice.node]


def assignment_move(*, session_key: str, node_name: str, reason: str = "moved by an operator") -> None:
    """Put a session on a given node (admin action); its next turn starts cold there."""
    node = Node.objects.get(name=node_name)
    with transaction.atomic():
        assignment = (
            SessionAssignment.objects.select_for_update(of=("self",))
            .select_related("node")
            .filter(session_key=session_key)
            .first()
        )
        if assignment is None:
            SessionAssignment.objects.create(session_key=session_key, node=node, reason=reason)
            Node.objects.filter(pk=node.pk).update(sessions=F("sessions") + 1)
        elif assignment.node_id != node.pk:
            _move(assignment, node, reason)


def _move(assignment: SessionAssignment, to: Node, reason: str) -> None:
    """Call inside the transaction that locked `assignment`."""
    from_name = assignment.node.name
    Node.objects.filter(pk=assignment.node_id).update(sessions=F("sessions") - 1)
    Node.objects.filter(pk=to.pk).update(sessions=F("sessions") + 1)
    AssignmentMove.objects.create(
        session_key=assignment.session_key, from_node=from_name, to_node=to.name, reason=reason
    )
    assignment.node = to
    assignment.reason = reason
    assignment.moved_at = timezone.now()
    assignment.moves = F("moves") + 1
    assignment.save(update_fields=["node", "reason", "moved_at", "moves"])
