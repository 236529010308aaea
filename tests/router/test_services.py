"""Assignment on real Postgres: stickiness, overload, drain, down nodes, and racing first turns."""

import random
import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from router import services
from router.models import AssignmentMove, Node, SessionAssignment
from router.policies import Choice, ClusterView, NodeLoad, RoutingPolicy
from tests.factories import NodeFactory


def test_a_session_sticks_to_its_first_node(nodes):
    first = services.session_node(session_key="s1")
    assert all(services.session_node(session_key="s1") == first for _ in range(5))
    assert SessionAssignment.objects.get(session_key="s1").node == first
    assert not AssignmentMove.objects.exists()


def test_an_overloaded_node_spills_the_session_and_records_why(nodes):
    """Past the last-resort bound (its sessions and its engine's work), even a warm session moves."""
    node = services.session_node(session_key="busy")
    Node.objects.filter(pk=node.pk).update(sessions=50, work=40.0)
    moved_to = services.session_node(session_key="busy")
    assert moved_to != node
    move = AssignmentMove.objects.get(session_key="busy")
    assert (move.from_node, move.to_node, move.reason) == (node.name, moved_to.name, "node overloaded")


def test_a_draining_node_takes_no_sessions_and_its_sessions_move(nodes):
    node = services.session_node(session_key="s")
    services.node_set_status(name=node.name, status=Node.Status.DRAINING)
    assert services.session_node(session_key="s") != node
    assert AssignmentMove.objects.get(session_key="s").reason == "node down or draining"
    assert all(services.session_node(session_key=f"new{i}") != node for i in range(20))


def test_a_session_leaving_its_node_goes_where_its_kv_state_can_be_restored(db):
    """Nodes that share the left node's disk tier can restore the session; one elsewhere would recompute."""
    Node.objects.update(status=Node.Status.DOWN)
    left = NodeFactory.create(kv_store="host-1:/var/kv")
    neighbour = NodeFactory.create(kv_store="host-1:/var/kv")
    elsewhere = [NodeFactory.create(kv_store=f"host-{i}:/var/kv") for i in (2, 3)]
    keys = [f"s{i}" for i in range(12)]
    for key in keys:
        services.assignment_move(session_key=key, node_name=left.name)
    services.node_set_status(name=left.name, status=Node.Status.DRAINING)

    assert {services.session_node(session_key=key).name for key in keys} == {neighbour.name}
    # A new session is placed by load as before, on any of them.
    placed = {services.session_node(session_key=f"new{i}").name for i in range(30)}
    assert placed == {neighbour.name, *(n.name for n in elsewhere)}


def test_a_node_that_misses_heartbeats_is_reaped_and_its_sessions_move(nodes, settings):
    node = services.session_node(session_key="s")
    Node.objects.filter(pk=node.pk).update(last_heartbeat=timezone.now() - timedelta(seconds=60))
    assert services.nodes_reap() == [node.name]
    assert Node.objects.get(pk=node.pk).status == Node.Status.UNRESPONSIVE
    assert services.session_node(session_key="s") != node


def test_no_healthy_node_is_a_clear_error(db):
    Node.objects.update(status=Node.Status.DOWN)
    NodeFactory.create(last_heartbeat=timezone.now() - timedelta(hours=1))
    with pytest.raises(services.NoHealthyNode, match="No inference node is up"):
        services.session_node(session_key="s")


def test_an_operator_can_move_a_session(nodes):
    node = services.session_node(session_key="s")
    target = next(n for n in nodes if n != node)
    services.assignment_move(session_key="s", node_name=target.name)
    assert services.session_node(session_key="s") == target
    assert AssignmentMove.objects.get(session_key="s").reason == "moved by an operator"


class ScatterThenStick(RoutingPolicy):
    """Places a new session on a random node, then keeps it: racers disagree unless the router serialises them."""

    def choose(self, *, session_key: str, current: NodeLoad | None, view: ClusterView, cold: bool = False) -> Choice:
        return Choice(current.name if current else random.choice(view.names), "test")


@pytest.mark.django_db(transaction=True)
def test_concurrent_first_turns_of_a_session_get_the_same_node(settings):
    settings.ROUTER_POLICIES = {"scatter": {"BACKEND": "tests.router.test_services.ScatterThenStick"}}
    settings.ROUTER_DEFAULT_POLICY = "scatter"
    Node.objects.update(status=Node.Status.DOWN)
    for i in range(4):
        NodeFactory.create(name=f"race{i}")
    chosen: list[str] = []
    barrier = threading.Barrier(8)

    def first_turn() -> None:
        try:
            barrier.wait()
            chosen.append(services.session_node(session_key="racing").name)
        finally:
            connection.close()

    threads = [threading.Thread(target=first_turn) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(chosen) == 8 and len(set(chosen)) == 1
    assert SessionAssignment.objects.filter(session_key="racing").count() == 1


def test_a_move_records_what_the_node_it_left_held(nodes):
    """From the left node's last heartbeat: the session's place, nothing (a free move: its list is whole),
    or unknown (its list was cut at the cap, or it never reported one)."""
    left, target = nodes[0], nodes[1]
    cases = {
        "warm": ({"sessions": {"warm": "ram"}, "sessions_complete": True}, "ram"),
        "cold": ({"sessions": {"warm": "ram"}, "sessions_complete": True}, "none"),
        "cut": ({"sessions": {"warm": "ram"}, "sessions_complete": False}, "unknown"),
        "silent": ({}, "unknown"),
    }
    for key, (stats, held) in cases.items():
        Node.objects.filter(pk=left.pk).update(stats=stats)
        services.assignment_move(session_key=key, node_name=left.name)
        services.assignment_move(session_key=key, node_name=target.name)
        move = AssignmentMove.objects.get(session_key=key, to_node=target.name)
        assert (move.held, move.warm) == (held, held == "ram"), key


def heartbeat(node: Node, **stats) -> None:
    served = services.ServedModel(node.model, "", node.chat_template, node.n_ctx, node.max_reply_tokens)
    services.node_heartbeat(name=node.name, capacity=node.capacity, stats=stats, incarnation="", served=served)


def test_a_heartbeat_counts_its_nodes_sessions_after_placements_moves_and_ends(nodes):
    """The one writer of a node's session count: placing, moving and ending a session write no node's row."""
    for i in range(3):
        services.assignment_move(session_key=f"s{i}", node_name=nodes[0].name)
    services.assignment_move(session_key="s2", node_name=nodes[1].name)
    services.assignment_end(session_key="s0")
    services.session_node(session_key="new", new=True)
    assert sum(Node.objects.values_list("sessions", flat=True)) == 0
    for node in nodes:
        heartbeat(node)
    counts = dict(Node.objects.filter(pk__in=[n.pk for n in nodes]).values_list("name", "sessions"))
    placed = SessionAssignment.objects.get(session_key="new").node.name
    expected = {n.name: 0 for n in nodes} | {nodes[0].name: 1}
    expected[nodes[1].name] += 1
    expected[placed] += 1
    assert counts == expected


def test_the_engines_work_and_kv_use_come_from_its_heartbeats_smoothed(nodes):
    node = nodes[0]
    heartbeat(node, running=8, waiting=4, kv_cells_used=300, kv_cells_total=1000)
    heartbeat(node, running=4, waiting=0, kv_cells_used=500, kv_cells_total=1000)
    node.refresh_from_db()
    assert (node.work, node.kv_use) == (0.5 * 12 * 0.5 + 0.5 * 4, 0.5)


def test_a_session_its_node_dropped_moves_for_free_and_one_kept_is_warm_again(nodes):
    """A heartbeat's `dropped` marks the session cold: on a node above the mean its next turn moves (the
    move records it was cold, so it is not counted warm); on a node within the mean it stays, warm again."""
    loaded = nodes[0]
    for i in range(3):
        services.assignment_move(session_key=f"s{i}", node_name=loaded.name)
    heartbeat(loaded, sessions={"s0": "resident"}, sessions_complete=True, dropped=["s1", "s2"])
    Node.objects.filter(pk=loaded.pk).update(sessions=12)  # 12 of 14 sessions: far above the mean
    assert set(SessionAssignment.objects.filter(cold=True).values_list("session_key", flat=True)) == {"s1", "s2"}

    assert services.session_node(session_key="s0") == loaded  # warm: within the last-resort bound, it stays
    moved_to = services.session_node(session_key="s1")
    move = AssignmentMove.objects.get(session_key="s1")
    assert moved_to != loaded and (move.reason, move.cold, move.warm) == ("cold, rebalanced", True, False)
    assert not SessionAssignment.objects.get(session_key="s1").cold

    Node.objects.filter(pk=loaded.pk).update(sessions=1)  # now below the mean: a cold session stays
    services.views_forget()  # (once the view is read again: until then it counts what it placed there)
    assert services.session_node(session_key="s2") == loaded
    assert not SessionAssignment.objects.get(session_key="s2").cold  # its turn runs there: warm again
    assert not AssignmentMove.objects.filter(session_key="s2").exists()


def test_a_turn_that_will_break_its_prefix_may_move_for_free(nodes):
    loaded = nodes[0]
    services.assignment_move(session_key="s", node_name=loaded.name)
    Node.objects.filter(pk=loaded.pk).update(sessions=12)
    assert services.session_node(session_key="s") == loaded
    assert services.session_node(session_key="s", cold=True) != loaded
    assert AssignmentMove.objects.get(session_key="s").cold


def test_a_node_the_view_still_counts_healthy_is_never_assigned(nodes, settings):
    """The router's view of the nodes is read once a second; a node that went down since (marked by another
    process, so this one's view is not told) is refused by the write itself, and the view read again."""
    settings.ROUTER_VIEW_SECONDS = 3600
    down = services.session_node(session_key="s")  # the view now holds all three
    Node.objects.filter(pk=down.pk).update(status=Node.Status.DOWN)  # as another process would
    placed = {services.session_node(session_key=f"new{i}").name for i in range(30)}
    assert down.name not in placed and len(placed) == 2


class FirstNode(RoutingPolicy):
    """Places on the first node by name, then keeps it: the one a stale view still names first."""

    def choose(self, *, session_key: str, current: NodeLoad | None, view: ClusterView, cold: bool = False) -> Choice:
        return Choice(current.name if current else view.names[0], "test")


def test_a_session_leaves_a_node_that_went_down_though_the_view_still_counts_it(nodes, settings):
    settings.ROUTER_POLICIES = {"first": {"BACKEND": "tests.router.test_services.FirstNode"}}
    settings.ROUTER_DEFAULT_POLICY = "first"
    settings.ROUTER_VIEW_SECONDS = 3600
    down = services.session_node(session_key="s")
    Node.objects.filter(pk=down.pk).update(status=Node.Status.DOWN)  # as another process would
    assert services.session_node(session_key="s") != down


def test_a_node_that_joined_after_the_view_was_read_keeps_its_sessions(nodes, settings):
    settings.ROUTER_VIEW_SECONDS = 3600
    services.session_node(session_key="warm-up")
    # Registered by another process (bulk_create sends no signal, as this process would not hear of it).
    [joined] = Node.objects.bulk_create([Node(name="late", queue="node.late", last_heartbeat=timezone.now())])
    services.assignment_move(session_key="s", node_name=joined.name)
    assert services.session_node(session_key="s") == joined
    assert not AssignmentMove.objects.filter(session_key="s", from_node="late").exists()


def test_a_node_that_came_up_after_the_view_was_read_takes_sessions_at_once(nodes, settings):
    """The view is read once a second; a decision that finds no node in it reads it again before saying
    that none is up."""
    settings.ROUTER_VIEW_SECONDS = 3600
    left = services.session_node(session_key="s")
    Node.objects.update(status=Node.Status.DOWN)  # as another process would
    with pytest.raises(services.NoHealthyNode):
        services.session_node(session_key="first")
    # Registered by another process (bulk_create sends no signal, as this process would not hear of it).
    [late] = Node.objects.bulk_create([Node(name="late", queue="node.late", last_heartbeat=timezone.now())])
    assert services.session_node(session_key="new") == late
    assert services.session_node(session_key="s") == late != left


def test_a_first_turn_is_placed_in_one_statement_and_a_follow_up_decided_in_one(
    nodes, settings, django_assert_num_queries
):
    settings.ROUTER_VIEW_SECONDS = 3600
    services.session_node(session_key="warm-up")  # reads the view
    with django_assert_num_queries(1):
        placed = services.session_node(session_key="s", new=True)
    with django_assert_num_queries(1):
        assert services.session_node(session_key="s") == placed
    assert SessionAssignment.objects.get(session_key="s").node == placed
    assert sum(Node.objects.values_list("sessions", flat=True)) == 0  # no node's row is written: heartbeats count


def test_the_hot_path_statements_are_prepared_once_a_connection_has_run_them(nodes, settings):
    """Postgres plans a placement and a follow-up's read once per connection, not on every call."""
    settings.ROUTER_VIEW_SECONDS = 3600
    for k in range(connection.settings_dict["OPTIONS"]["prepare_threshold"] + 1):
        services.session_node(session_key=f"s{k}", new=True)
        services.session_node(session_key=f"s{k}")
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        prepared = [row[0] for row in cursor.fetchall()]
    assert any("INSERT INTO router_sessionassignment" in s for s in prepared), prepared
    assert any("WHERE a.session_key = $1" in s for s in prepared), prepared


def test_a_wrong_first_turn_hint_costs_a_read_never_a_move(nodes, settings, django_assert_num_queries):
    """A session whose first turn failed has a node though no finished turn: it stays there."""
    settings.ROUTER_POLICIES = {"first": {"BACKEND": "tests.router.test_services.FirstNode"}}
    settings.ROUTER_DEFAULT_POLICY = "first"
    settings.ROUTER_VIEW_SECONDS = 3600
    services.assignment_move(session_key="s", node_name=nodes[2].name)  # not the node the policy places on
    services.session_node(session_key="warm-up")
    with django_assert_num_queries(2):  # the placement is refused (it has a node), then it is read
        assert services.session_node(session_key="s", new=True) == nodes[2]
    assert not AssignmentMove.objects.filter(session_key="s").exists()
    # A session with a hint whose node went down moves as without one.
    Node.objects.filter(pk=nodes[2].pk).update(status=Node.Status.DOWN)
    assert services.session_node(session_key="s", new=True) != nodes[2]
    assert AssignmentMove.objects.get(session_key="s").reason == "node down or draining"


def test_what_a_model_is_served_with_comes_from_the_routing_view_read_again_when_it_names_no_node(
    db, settings, django_assert_num_queries
):
    """Asked on every turn, so it reads nothing while the view is fresh; a model no node in the view serves
    (one registered by another process since) is read again at once."""
    settings.ROUTER_VIEW_SECONDS = 3600
    Node.objects.update(status=Node.Status.DOWN)
    NodeFactory.create(name="wide", model="m", n_ctx=8192, max_reply_tokens=512)
    NodeFactory.create(name="narrow", model="m", n_ctx=4096, max_reply_tokens=256)
    assert services.served_model("m") == services.served_models()["m"]
    with django_assert_num_queries(0):
        served = services.served_model("m")
    assert served is not None and (served.n_ctx, served.max_reply_tokens) == (4096, 256)  # the tightest
    with django_assert_num_queries(1):
        assert services.served_model("other") is None
    Node.objects.filter(name="narrow").update(model="other")  # as another process would: no signal here
    with django_assert_num_queries(1):
        assert services.served_model("other") is not None
