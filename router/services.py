"""Which node serves a session: the node registry and sticky, bounded-load assignment.

The router decides where, never how. Nodes register and heartbeat
themselves; one that misses heartbeats for ROUTER_NODE_TIMEOUT_SECONDS is no
longer healthy and is marked down by the next reaper pass.
"""

import dataclasses
import hashlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Q
from django.utils import timezone

from router import registry
from router.models import AssignmentMove, Node, NodeSample, SessionAssignment
from router.policies import NodeLoad, RoutingPolicy

# The load figures a node's history keeps from its heartbeats' stats.
SAMPLED = (
    "running",
    "waiting",
    "kv_cells_used",
    "kv_cells_total",
    "resident_sessions",
    "spilled_sessions",
    "disk_sessions",
)


class NoHealthyNode(RuntimeError):
    pass


class MoveRefused(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class ServedModel:
    """What a node serves, as it reports it at start and in each heartbeat."""

    model: str
    model_path: str
    chat_template: str
    n_ctx: int
    max_reply_tokens: int
    kv_store: str = ""  # where its disk tier is (host:path); nodes sharing one restore each other's sessions


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


def node_heartbeat(
    *, name: str, capacity: int, stats: dict[str, Any], incarnation: str, served: ServedModel, sample: bool = False
) -> Node.Status | None:
    """Register the node (up, if new) or refresh its heartbeat and stats, if `incarnation` is the process
    serving under this name; with `sample`, also keep its load in its history. A node marked unresponsive
    while it was alive (stalled) is up again; a drained or downed node stays so. A heartbeat from a process
    that another has replaced changes nothing. Returns the node's status (None: another process serves
    under the name)."""
    now = timezone.now()
    fields = {"queue": queue_for_node(name), "capacity": capacity, "stats": stats, "last_heartbeat": now}
    fields |= dataclasses.asdict(served)
    with transaction.atomic():
        node, created = Node.objects.select_for_update().get_or_create(
            name=name, defaults=fields | {"incarnation": incarnation, "started_at": now, "status": Node.Status.UP}
        )
        if not created and node.incarnation not in (incarnation, ""):
            return None
        if sample:
            _keep_sample(node, stats, now)
        if created:
            return Node.Status.UP
        for field, value in fields.items():
            setattr(node, field, value)
        node.incarnation = incarnation
        if node.status == Node.Status.UNRESPONSIVE:
            node.status = Node.Status.UP
        node.save(update_fields=[*fields, "incarnation", "status"])
        return Node.Status(node.status)


def _keep_sample(node: Node, stats: dict[str, Any], now) -> None:
    """Add the node's load now to its history, and forget what is older than ROUTER_NODE_HISTORY_HOURS."""
    counts = {f: int(stats.get(f) or 0) for f in SAMPLED}
    NodeSample.objects.create(node=node, at=now, **counts)
    NodeSample.objects.filter(node=node, at__lt=now - timedelta(hours=settings.ROUTER_NODE_HISTORY_HOURS)).delete()


def node_start(*, name: str, capacity: int, incarnation: str, served: ServedModel) -> None:
    """A node process (re)joining under `name`: it replaces any earlier one, and is up whatever that was."""
    now = timezone.now()
    fields = {"queue": queue_for_node(name), "capacity": capacity, "stats": {}, "last_heartbeat": now}
    fields |= dataclasses.asdict(served)
    fields |= {"incarnation": incarnation, "started_at": now, "status": Node.Status.UP}
    Node.objects.update_or_create(name=name, defaults=fields)


def node_stop(*, name: str, incarnation: str) -> bool:
    """A node process stopping cleanly: down, unless another process serves under its name by now
    (False then: that one owns the name and its turns)."""
    return bool(Node.objects.filter(name=name, incarnation=incarnation).update(status=Node.Status.DOWN))


def node_set_status(*, name: str, status: Node.Status) -> None:
    Node.objects.filter(name=name).update(status=status)


def nodes_reap() -> list[str]:
    """Mark unresponsive the serving nodes whose heartbeat is older than the timeout; return their names."""
    with transaction.atomic():
        stale = list(
            Node.objects.select_for_update(skip_locked=True)
            .filter(_stale_q())
            .filter(status__in=[Node.Status.UP, Node.Status.DRAINING])
            .values_list("name", flat=True)
        )
        Node.objects.filter(name__in=stale).update(status=Node.Status.UNRESPONSIVE)
    return stale


def _heartbeat_cutoff():
    return timezone.now() - timedelta(seconds=settings.ROUTER_NODE_TIMEOUT_SECONDS)


def _stale_q() -> Q:
    return Q(last_heartbeat__lt=_heartbeat_cutoff()) | Q(last_heartbeat__isnull=True)


def is_healthy(node: Node) -> bool:
    """Up, and heard from within the timeout: it may take new sessions."""
    fresh = node.last_heartbeat is not None and node.last_heartbeat >= _heartbeat_cutoff()
    return node.status == Node.Status.UP and fresh


def healthy_nodes(*, model: str | None = None) -> list[Node]:
    """Nodes that may take new sessions: all of them, or those serving `model`."""
    nodes = Node.objects.filter(status=Node.Status.UP).exclude(_stale_q())
    return list((nodes if model is None else nodes.filter(model=model)).order_by("name"))


def served_models() -> dict[str, ServedModel]:
    """The models some healthy node serves, each with the tightest limits among its nodes."""
    served: dict[str, ServedModel] = {}
    for node in healthy_nodes():
        if node.model:
            known = served.get(node.model)
            served[node.model] = ServedModel(
                model=node.model,
                model_path=node.model_path,
                chat_template=node.chat_template,
                n_ctx=min(node.n_ctx, known.n_ctx) if known else node.n_ctx,
                max_reply_tokens=min(node.max_reply_tokens, known.max_reply_tokens) if known else node.max_reply_tokens,
            )
    return served


def known_models() -> set[str]:
    """Every model a node has ever registered, up or not."""
    return set(Node.objects.exclude(model="").values_list("model", flat=True).distinct())


# Assignment ---------------------------------------------------------------------


def session_node(*, session_key: str, policy: str | None = None, model: str | None = None) -> Node:
    """The node for this session's next turn, among the healthy nodes serving `model` (None: any): kept
    while healthy and not overloaded, else moved and recorded.

    The common cases cost one statement each: a follow-up that stays put is
    decided from a single read, and a new session is placed by a single insert
    that also counts it. Moving a session (its node is down, draining or
    overloaded, or another request placed it first) locks its assignment row
    and decides again under the lock, so racing turns of one session agree.
    """
    chooser = policy_get(policy)
    nodes, current = _healthy_nodes_and_current(session_key, model)
    if not nodes:
        serving = f" serves the model {model}" if model else " is up"
        raise NoHealthyNode(f"No inference node{serving}; try again shortly.")
    by_name = {n.name: n for n in nodes}
    loads = [NodeLoad(n.name, n.sessions) for n in nodes]
    if current is not None and chooser.choose(session_key=session_key, current=current, nodes=loads).node == current:
        return by_name[current]
    if current is None:
        choice = chooser.choose(session_key=session_key, current=None, nodes=loads)
        if _place_new(session_key, by_name[choice.node], choice.reason):
            return by_name[choice.node]
    with transaction.atomic():
        assignment = (
            SessionAssignment.objects.select_for_update(of=("self",))
            .select_related("node")
            .get(session_key=session_key)
        )
        current = assignment.node.name if assignment.node.name in by_name else None
        if current is None:  # it must leave its node: prefer those that can restore its state from disk
            loads = [n for n in loads if _shares_state(by_name[n.name], assignment.node)] or loads
        choice = chooser.choose(session_key=session_key, current=current, nodes=loads)
        if choice.node != assignment.node.name:
            _move(assignment, by_name[choice.node], choice.reason if current else _why_moved(assignment.node, model))
        return by_name[choice.node]


def _healthy_nodes_and_current(session_key: str, model: str | None) -> tuple[list[Node], str | None]:
    """Healthy nodes (of `model`) with their loads, and the session's node if it is one of them: one query
    (hot path)."""
    nodes = list(
        Node.objects.raw(
            """
            SELECT n.id, n.name, n.queue, n.status, n.capacity, n.sessions, n.last_heartbeat, n.model, n.kv_store,
                   EXISTS (SELECT 1 FROM router_sessionassignment a
                           WHERE a.session_key = %s AND a.node_id = n.id) AS is_current
            FROM router_node n
            WHERE n.status = %s AND n.last_heartbeat >= %s AND (%s::text IS NULL OR n.model = %s)
            ORDER BY n.name
            """,
            [session_key, Node.Status.UP, _heartbeat_cutoff(), model, model],
        )
    )
    current = next((n.name for n in nodes if n.is_current), None)  # type: ignore[attr-defined]
    return nodes, current


def _shares_state(node: Node, old: Node) -> bool:
    """`node` reads the disk tier `old` wrote its sessions to, and serves the same model."""
    return bool(old.kv_store) and node.kv_store == old.kv_store and node.model == old.model


def _why_moved(node: Node, model: str | None) -> str:
    return "model changed" if model is not None and node.model != model else "node down or draining"


def _place_new(session_key: str, node: Node, reason: str) -> bool:
    """Assign a session that has no node yet and count it, in one statement; False if it already has one."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH placed AS (
                INSERT INTO router_sessionassignment (session_key, node_id, reason, assigned_at, moves)
                VALUES (%s, %s, %s, now(), 0)
                ON CONFLICT (session_key) DO NOTHING
                RETURNING node_id
            )
            UPDATE router_node SET sessions = sessions + 1 WHERE id IN (SELECT node_id FROM placed) RETURNING id
            """,
            [session_key, node.pk, reason],
        )
        return cursor.fetchone() is not None


def assignment_move(*, session_key: str, node_name: str, reason: str = "moved by an operator") -> None:
    """Put a session on a given node (admin action); its next turn starts cold there. Raises MoveRefused
    for a node that is not up, or that serves another model than the session's node."""
    node = Node.objects.filter(name=node_name).first()
    if node is None or node.status != Node.Status.UP:
        raise MoveRefused(f"Node {node_name} is not up.")
    with transaction.atomic():
        assignment = _locked_assignment(session_key)
        if assignment is not None and assignment.node.model != node.model:
            raise MoveRefused(f"Node {node_name} serves {node.model}, not {assignment.node.model}.")
        if assignment is None:
            SessionAssignment.objects.create(session_key=session_key, node=node, reason=reason)
            Node.objects.filter(pk=node.pk).update(sessions=F("sessions") + 1)
        elif assignment.node_id != node.pk:
            _move(assignment, node, reason)


def assignment_end(*, session_key: str) -> str | None:
    """Forget a session's assignment and uncount it from its node (its conversation was deleted); the name
    of that node, or None if the session had none."""
    with transaction.atomic():
        assignment = _locked_assignment(session_key)
        if assignment is None:
            return None
        Node.objects.filter(pk=assignment.node_id).update(sessions=F("sessions") - 1)
        assignment.delete()
        return assignment.node.name


def held_by(node: Node, session_key: str) -> str:
    """What `node` held of the session's cached state at its last heartbeat (AssignmentMove.Held)."""
    stats = node.stats
    listed = stats.get("sessions")
    if listed is None:
        return AssignmentMove.Held.UNKNOWN
    if session_key in listed:
        return listed[session_key]
    return AssignmentMove.Held.NONE if stats.get("sessions_complete") else AssignmentMove.Held.UNKNOWN


def _locked_assignment(session_key: str) -> SessionAssignment | None:
    """The session's assignment with its node, locked for this transaction; None if it has none."""
    return (
        SessionAssignment.objects.select_for_update(of=("self",))
        .select_related("node")
        .filter(session_key=session_key)
        .first()
    )


def _move(assignment: SessionAssignment, to: Node, reason: str) -> None:
    """Call inside the transaction that locked `assignment`."""
    from_name = assignment.node.name
    # Lock both nodes in one order (by pk) so that opposite moves cannot deadlock.
    list(Node.objects.select_for_update().filter(pk__in=[assignment.node_id, to.pk]).order_by("pk"))
    Node.objects.filter(pk=assignment.node_id).update(sessions=F("sessions") - 1)
    Node.objects.filter(pk=to.pk).update(sessions=F("sessions") + 1)
    AssignmentMove.objects.create(
        session_key=assignment.session_key,
        from_node=from_name,
        to_node=to.name,
        reason=reason,
        held=held_by(assignment.node, assignment.session_key),
    )
    assignment.node = to
    assignment.reason = reason
    assignment.moved_at = timezone.now()
    assignment.moves = F("moves") + 1
    assignment.save(update_fields=["node", "reason", "moved_at", "moves"])
