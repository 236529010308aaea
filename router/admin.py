from django.contrib import admin, messages
from django.contrib.admin.options import Action, ActionLocation
from django.db.models import QuerySet
from django.http import HttpRequest

from router import node_pages, services
from router.models import AssignmentMove, Node, SessionAssignment


class ReadOnly:
    """Written by the product only (nodes register and heartbeat, the router assigns and moves, services
    write turns): the admin shows it, and changes go through actions that call the same services."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Node)
class NodeAdmin(ReadOnly, admin.ModelAdmin):
    list_display = (
        "name",
        "model",
        "status",
        "healthy",
        "sessions",
        "capacity",
        "running",
        "work",
        "kv_used",
        "on_disk",
        "last_heartbeat",
    )
    list_filter = ("status", "model")
    search_fields = ("name", "model")
    # What the node registered about itself (the model it serves, its limits) and its load.
    fieldsets = (
        (None, {"fields": ("name", "status", "healthy", "last_heartbeat", "started_at", "incarnation")}),
        ("Serves", {"fields": ("model", "model_path", "chat_template", "n_ctx", "max_reply_tokens", "capacity")}),
        (
            "Load",
            {
                "fields": (
                    "running",
                    "work",
                    "kv_use",
                    "kv_used",
                    "load",
                    "sessions",
                    "held_sessions",
                    "on_disk",
                    "kv_store",
                )
            },
        ),
        ("Raw stats", {"classes": ["collapse"], "fields": ("stats",)}),
    )
    readonly_fields = ("healthy", "running", "kv_used", "load", "held_sessions", "on_disk")
    actions = ["drain", "mark_down", "mark_up"]

    @admin.display(description="KV use and sessions over time")
    def load(self, node: Node) -> str:
        return node_pages.render_load(node)

    @admin.display(description="its sessions")
    def held_sessions(self, node: Node) -> str:
        return node_pages.render_sessions(node)

    @admin.display(boolean=True)
    def healthy(self, node: Node) -> bool:
        return services.is_healthy(node)

    @admin.display(description="running")
    def running(self, node: Node) -> int | None:
        return node.stats.get("running")

    @admin.display(description="KV cells used")
    def kv_used(self, node: Node) -> str:
        return f"{node.stats.get('kv_cells_used', 0)} / {node.stats.get('kv_cells_total', 0)}"

    @admin.display(description="disk tier")
    def on_disk(self, node: Node) -> str:
        """The sessions and MiB in the disk tier this node uses (shared with the nodes using the same one)."""
        sessions, size = node.stats.get("disk_sessions", 0), node.stats.get("disk_bytes", 0) / 2**20
        return f"{sessions} sessions, {size:.0f} MiB" if node.kv_store else "off"

    def _set(self, request: HttpRequest, queryset: QuerySet[Node], status: Node.Status, verb: str) -> None:
        for node in queryset:
            services.node_set_status(name=node.name, status=status)
        self.message_user(request, f"{queryset.count()} node(s) {verb}.", messages.SUCCESS)

    @admin.action(description="Drain: take no new sessions, let running turns finish, write sessions to disk")
    def drain(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._set(request, queryset, Node.Status.DRAINING, "draining")

    @admin.action(description="Mark down: route nothing here")
    def mark_down(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._set(request, queryset, Node.Status.DOWN, "marked down")

    @admin.action(description="Mark up")
    def mark_up(self, request: HttpRequest, queryset: QuerySet[Node]) -> None:
        self._set(request, queryset, Node.Status.UP, "marked up")


@admin.register(SessionAssignment)
class SessionAssignmentAdmin(ReadOnly, admin.ModelAdmin):
    """Moves go through the router's service (an action per node that is up), so loads and the move log
    stay right."""

    list_display = ("session_key", "node", "reason", "moves", "cold", "assigned_at", "moved_at")
    list_filter = ("node", "reason", "cold")
    search_fields = ("session_key",)
    list_select_related = ("node",)

    def get_actions(self, request: HttpRequest, action_location=ActionLocation.CHANGE_LIST):
        actions = super().get_actions(request, action_location)
        if action_location == ActionLocation.CHANGE_LIST:
            for node in Node.objects.filter(status=Node.Status.UP).only("name"):
                name = f"move_to_{node.name}"
                text = f"Move to node {node.name} (the next turn starts cold there)"
                actions[name] = Action(_mover(node.name), name, text, text, [ActionLocation.CHANGE_LIST])
        return actions


def _mover(node_name: str):
    def move(model_admin: admin.ModelAdmin, request: HttpRequest, queryset: QuerySet[SessionAssignment]) -> None:
        for assignment in queryset:
            try:
                services.assignment_move(session_key=assignment.session_key, node_name=node_name)
            except services.MoveRefused as exc:
                model_admin.message_user(request, f"Not moved: {assignment.session_key}: {exc}", messages.ERROR)
            else:
                model_admin.message_user(request, f"Moved {assignment.session_key} to {node_name}.", messages.SUCCESS)

    return move


@admin.register(AssignmentMove)
class AssignmentMoveAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("session_key", "from_node", "to_node", "reason", "held", "cold", "warm", "created_at")
    list_filter = ("reason", "held", "cold", "to_node")

    @admin.display(boolean=True, description="warm (it lost a usable cache)")
    def warm(self, move: AssignmentMove) -> bool:
        return move.warm

    search_fields = ("session_key",)
