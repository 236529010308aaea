"""Which node serves a session: the node registry and sticky, bounded-load assignment.

The router decides where, never how. Nodes register and heartbeat
themselves; one that misses heartbeats for ROUTER_NODE_TIMEOUT_SECONDS is no
longer healthy and is marked down by the next reaper pass.
"""

import dataclasses
import hashlib
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from django.conf import settings
from django.db import connection, transaction
from django.db.models import Count, F, OuterRef, Q, Subquery
from django.db.models.functions import Coalesce
from django.db.models.signals import post_save
from django.dispatch import receiver
from django.utils import timezone

from router import registry
from router.models import AssignmentMove, Node, NodeSample, SessionAssignment
from router.policies import ClusterView, NodeLoad, RoutingPolicy, smoothed

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
    serving under this name; with `sample`, also keep its load in its history. Its work (requests running
    and waiting, smoothed), KV use and sessions (its assignments, counted here: the heartbeat is the one
    writer of the figure, so that placing a session writes no node's row) are what the router balances;
    the sessions it reports `dropped` from memory are marked cold, so the router may move them for free. A
    node marked unresponsive while it was alive (stalled) is up again; a drained or downed node stays so. A
    heartbeat from a process that another has replaced changes nothing. Returns the node's status (None:
    another process serves under the name)."""
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
        node.work = smoothed(node.work, int(stats.get("running") or 0) + int(stats.get("waiting") or 0))
        node.kv_use = (stats.get("kv_cells_used") or 0) / (stats.get("kv_cells_total") or 1)
        if node.status == Node.Status.UNRESPONSIVE:
            node.status = Node.Status.UP
        node.save(update_fields=[*fields, "incarnation", "status", "work", "kv_use"])
        Node.objects.filter(pk=node.pk).update(sessions=sessions_counted())
        if dropped := stats.get("dropped"):
            SessionAssignment.objects.filter(node=node, session_key__in=dropped, cold=False).update(cold=True)
        return Node.Status(node.status)


def sessions_counted() -> Coalesce:
    """A node's sessions, counted from its assignments, for an update of node rows: heartbeats write it (the
    one writer of `Node.sessions`), so that placing, moving or ending a session writes no node's row."""
    counted = SessionAssignment.objects.filter(node=OuterRef("pk")).order_by().values("node").annotate(n=Count("pk"))
    return Coalesce(Subquery(counted.values("n")), 0)


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
    views_forget()


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
    if stale:
        views_forget()
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
    return list(_healthy(model).order_by("name"))


def _healthy(model: str | None):
    nodes = Node.objects.filter(status=Node.Status.UP).exclude(_stale_q())
    return nodes if model is None else nodes.filter(model=model)


_SERVED = ("model", "model_path", "chat_template", "n_ctx", "max_reply_tokens")


def served_models() -> dict[str, ServedModel]:
    """The models some healthy node serves, each with the tightest limits among its nodes (only these
    columns: a node's stats, written by its heartbeats, run to kilobytes)."""
    return _served_by(_healthy(None).only("name", *_SERVED))


def served_model(model: str) -> ServedModel | None:
    """What the healthy nodes serving `model` serve (None: none does), from this process's view of them,
    the one its routing decisions use: asked on every turn, it reads nothing while the view is fresh, and
    reads it again when it names no node. A node that left since is no loss: routing checks each node it
    picks (and `session_node` refuses when none is healthy)."""
    with _VIEWS.lock:
        _, known = _VIEWS.get(model, if_empty=True)
        return _served_by(known.values()).get(model)


def _served_by(nodes: Iterable[Any]) -> dict[str, ServedModel]:
    """The models these nodes (rows with a name and the `_SERVED` fields) serve, each with the tightest
    limits among its nodes (and the file and template of the last by name)."""
    served: dict[str, ServedModel] = {}
    for node in sorted(nodes, key=lambda node: node.name):
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


def session_node(
    *, session_key: str, policy: str | None = None, model: str | None = None, cold: bool = False, new: bool = False
) -> Node:
    """The node for this session's next turn, among the healthy nodes serving `model` (None: any): kept
    while healthy and within the policy's load bound, else moved and recorded. `cold`: the caller knows
    the session's cache is no use for this turn (its prompt will break its prefix), so a move is free.
    `new`: the caller believes the session has no node yet (its first turn), so it is placed without
    reading its assignment first; a wrong belief costs that read afterwards, never a wrong placement.

    The common cases cost one statement each and no scan of the nodes: a follow-up that stays put is
    decided from its own row and its node's (joined), against this process's view of the cluster; a new
    session is placed by a single statement that inserts its assignment if its node is still healthy. Moving a
    session (its node is down, draining or overloaded, or another request placed it first) locks its
    assignment row and decides again under the lock, so racing turns of one session agree.
    """
    chooser = policy_get(policy)
    if new and (placed := _place(chooser, session_key, model, refresh=False)) is not None:
        return placed
    node = _assigned_node(session_key)
    was_cold = node is not None and node.assignment_cold  # type: ignore[attr-defined]
    if node is not None and _serves(node, model) and _stays(chooser, session_key, node, model, cold or was_cold):
        if was_cold:  # its turn runs there: warm again
            SessionAssignment.objects.filter(session_key=session_key).update(cold=False)
        return node
    for attempt in range(2):  # the second time with the nodes read afresh: the view named one no longer healthy
        if node is None:
            placed = _place(chooser, session_key, model, refresh=attempt > 0)
            if placed is not None:
                return placed
            node = _assigned_node(session_key)  # None: the node was no longer healthy; else a racer placed it
            if node is None:
                continue
        moved = _move_locked(chooser, session_key, model, cold, refresh=attempt > 0)
        if moved is not None:
            return moved
        node = None
    raise NoHealthyNode(_no_node_message(model))


def _stays(chooser: RoutingPolicy, session_key: str, node: Node, model: str | None, cold: bool) -> bool:
    """Whether the policy keeps the session on its healthy node, judged on that node's figures now."""
    with _VIEWS.lock:
        view, _ = _VIEWS.get(model)
        if node.name not in view:  # a node that joined since the view was read
            view, _ = _VIEWS.get(model, refresh=True)
        if node.name not in view:
            return True
        current = _load_of(node, view)
        view.update(current)
        return chooser.choose(session_key=session_key, current=current, view=view, cold=cold).node == node.name


def _place(chooser: RoutingPolicy, session_key: str, model: str | None, *, refresh: bool) -> Node | None:
    """Place a session that has no node; None if it has one by now (another request placed it first), or if
    the chosen node was no longer healthy (the view is then read afresh next time)."""
    with _VIEWS.lock:
        view, by_name = _VIEWS.get(model, refresh=refresh, if_empty=True)
        if not len(view):
            raise NoHealthyNode(_no_node_message(model))
        choice = chooser.choose(session_key=session_key, current=None, view=view)
    node = by_name[choice.node].node()
    healthy, placed = _place_new(session_key, node, choice.reason)
    if placed:
        _VIEWS.counted(model, choice.node, 1)
        return node
    if not healthy:
        _VIEWS.forget(model)
    return None


def _move_locked(
    chooser: RoutingPolicy, session_key: str, model: str | None, cold: bool, *, refresh: bool
) -> Node | None:
    """Decide again under the session's row lock, and move it if the policy says so; None if the chosen node
    was no longer healthy."""
    with transaction.atomic():
        assignment = (
            SessionAssignment.objects.select_for_update(of=("self",))
            .select_related("node")
            .get(session_key=session_key)
        )
        old = assignment.node
        cold = cold or assignment.cold
        with _VIEWS.lock:
            view, by_name = _VIEWS.get(model, refresh=refresh)
            if _serves(old, model) and old.name not in view:  # a node that joined since the view was read
                view, by_name = _VIEWS.get(model, refresh=True)
            current = _load_of(old, view) if old.name in view and _serves(old, model) else None
            if current is None:  # it must leave: prefer the nodes that can restore it from their disk tier
                others = [name for name in by_name if name != old.name]  # (the view may not know it left yet)
                if not others and not refresh:  # a node may have come up since the view was read
                    view, by_name = _VIEWS.get(model, refresh=True)
                    others = [name for name in by_name if name != old.name]
                sharing = [name for name in others if _shares_state(by_name[name].kv_store, by_name[name].model, old)]
                view = view.only(sharing or others)
            else:
                view.update(current)
            if not len(view):
                raise NoHealthyNode(_no_node_message(model))
            choice = chooser.choose(session_key=session_key, current=current, view=view, cold=cold)
        if choice.node == old.name:
            return old
        reason = choice.reason if current is not None else _why_moved(old, model)
        target = by_name[choice.node].node()
        if not _move(assignment, target, reason, cold=cold, only_if_healthy=True):
            return None
    _VIEWS.counted(model, old.name, -1)
    _VIEWS.counted(model, choice.node, 1)
    return target


def _no_node_message(model: str | None) -> str:
    serving = f" serves the model {model}" if model else " is up"
    return f"No inference node{serving}; try again shortly."


_ASSIGNED_COLUMNS = ("id", "name", "queue", "status", "capacity", "sessions", "work", "kv_use", "last_heartbeat")


def _assigned_node(session_key: str) -> Node | None:
    """The session's node with its load now (not its stats, which can be large), and whether the session
    is cold there: one indexed read, on the hot path (a raw, prepared statement: a third of the ORM's cost)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            SELECT n.id, n.name, n.queue, n.status, n.capacity, n.sessions, n.work, n.kv_use, n.last_heartbeat,
                   n.model, n.kv_store, a.cold
            FROM router_sessionassignment a JOIN router_node n ON n.id = a.node_id
            WHERE a.session_key = %s
            """,
            [session_key],
        )
        row = cursor.fetchone()
    if row is None:
        return None
    *columns, model, kv_store, cold = row
    node = Node(**dict(zip(_ASSIGNED_COLUMNS, columns, strict=True)), model=model, kv_store=kv_store)
    node.assignment_cold = cold  # type: ignore[attr-defined]
    return node


def _serves(node: Node, model: str | None) -> bool:
    return is_healthy(node) and (model is None or node.model == model)


def _load_of(node: Node, view: ClusterView) -> NodeLoad:
    """The node's load now: its work and KV use as its last heartbeat reported them; its sessions the more
    of its heartbeat's count and this process's view's (the count when the view was read, plus this
    process's placements since), since each may miss placements the other has seen."""
    return NodeLoad(node.name, max(node.sessions, view.get(node.name).sessions), node.work, node.kv_use)


class _Known(NamedTuple):
    """A healthy node as the view read it."""

    id: int
    name: str
    queue: str
    capacity: int
    model: str
    kv_store: str
    sessions: int
    work: float
    kv_use: float
    model_path: str
    chat_template: str
    n_ctx: int
    max_reply_tokens: int

    def node(self) -> Node:
        return Node(**{field: getattr(self, field) for field in self._fields})


class _ClusterViews:
    """This process's view of the healthy nodes, per model: read every ROUTER_VIEW_SECONDS (one scan of
    the nodes, shared by all decisions in between), kept up to date with this process's own placements,
    and read again at once when a decision finds it out of date. A node's sessions are counted by its
    heartbeat, so other routers' placements (and this one's before the heartbeat) show at the first read
    after it, a few seconds late; a node that stopped being healthy is never assigned, since every write
    checks it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._views: dict[str | None, tuple[float, ClusterView, dict[str, _Known]]] = {}

    def get(
        self, model: str | None, *, refresh: bool = False, if_empty: bool = False
    ) -> tuple[ClusterView, dict[str, "_Known"]]:
        """Call holding `lock`. `if_empty`: read again a kept view that names no node (one may have come up
        since). Reading 1,000 nodes takes a few milliseconds (plain rows, not models)."""
        now = time.monotonic()
        cached = self._views.get(model)
        if refresh or cached is None or now - cached[0] > settings.ROUTER_VIEW_SECONDS or (if_empty and not cached[2]):
            rows = [_Known(*row) for row in _healthy(model).values_list(*_Known._fields)]
            view = ClusterView(NodeLoad(r.name, r.sessions, r.work, r.kv_use) for r in rows)
            cached = (now, view, {r.name: r for r in rows})
            self._views[model] = cached
        return cached[1], cached[2]

    def counted(self, model: str | None, name: str, delta: int) -> None:
        with self.lock:
            cached = self._views.get(model)
            if cached is not None and name in cached[1]:
                cached[1].add_sessions(name, delta)

    def forget(self, model: str | None = None, *, every: bool = False) -> None:
        with self.lock:
            if every:
                self._views.clear()
            else:
                self._views.pop(model, None)


_VIEWS = _ClusterViews()


def views_forget() -> None:
    """Read the nodes afresh at the next decision (this process changed a node's status)."""
    _VIEWS.forget(every=True)


def _shares_state(kv_store: str, model: str, old: Node) -> bool:
    """A node of this disk tier and model reads what `old` wrote its sessions to."""
    return bool(old.kv_store) and kv_store == old.kv_store and model == old.model


def _why_moved(node: Node, model: str | None) -> str:
    return "model changed" if model is not None and node.model != model else "node down or draining"


def _place_new(session_key: str, node: Node, reason: str) -> tuple[bool, bool]:
    """Assign a session that has no node yet to `node` if it is still healthy, in one statement that writes
    the assignment alone (the node's heartbeat counts it). Returns whether the node was healthy, and whether
    the session was placed (not if it already has a node)."""
    with connection.cursor() as cursor:
        cursor.execute(
            """
            WITH target AS (
                SELECT id FROM router_node WHERE id = %s AND status = %s AND last_heartbeat >= %s
            ), placed AS (
                INSERT INTO router_sessionassignment (session_key, node_id, reason, assigned_at, moves, cold)
                SELECT %s, id, %s, now(), 0, false FROM target
                ON CONFLICT (session_key) DO NOTHING
                RETURNING node_id
            )
            SELECT EXISTS (SELECT 1 FROM target), EXISTS (SELECT 1 FROM placed)
            """,
            [node.pk, Node.Status.UP, _heartbeat_cutoff(), session_key, reason],
        )
        return cursor.fetchone()


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
        elif assignment.node_id != node.pk:
            _move(assignment, node, reason)


def assignment_end(*, session_key: str) -> str | None:
    """Forget a session's assignment (its conversation was deleted; its node's next heartbeat uncounts it);
    the name of that node, or None if the session had none."""
    with transaction.atomic():
        assignment = _locked_assignment(session_key)
        if assignment is None:
            return None
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


def _move(
    assignment: SessionAssignment, to: Node, reason: str, *, cold: bool = False, only_if_healthy: bool = False
) -> bool:
    """Call inside the transaction that locked `assignment`. With `only_if_healthy`, False (and nothing
    changed) if `to` is no longer healthy as read now (as a placement checks it). The nodes' heartbeats
    count the move."""
    from_name = assignment.node.name
    if only_if_healthy:
        fresh = Node.objects.filter(pk=to.pk).first()
        if fresh is None or not is_healthy(fresh):
            return False
    AssignmentMove.objects.create(
        session_key=assignment.session_key,
        from_node=from_name,
        to_node=to.name,
        reason=reason,
        held=held_by(assignment.node, assignment.session_key),
        cold=cold,
    )
    assignment.node = to
    assignment.reason = reason
    assignment.moved_at = timezone.now()
    assignment.moves = F("moves") + 1
    assignment.cold = False
    assignment.save(update_fields=["node", "reason", "moved_at", "moves", "cold"])
    return True


@receiver(post_save, sender=Node)
def _node_saved(*, created: bool, **kwargs: Any) -> None:
    if created:  # a node registered from this process: decide with it at once
        views_forget()
