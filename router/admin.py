from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest

from router import services
from router.models import AssignmentMove, Node, SessionAssignment


class ReadOnly:
    """Written by the product only (nodes register and heartbeat, the router assigns and moves, services
    write turns): the admin shows it, and changes go through actions that call the same services."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
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
        "kv_used",
        "on_disk",
        "last_heartbeat",
    )
    list_filter = ("status", "model")
    search_fields = ("name", "model")
    # What the node registered about itself: the model it serves and its limits.
    readonly_fields = (
        "stats",
        "last_heartbeat",
        "started_at",
        "sessions",
        "model",
        "model_path",
        "chat_template",
        "n_ctx",
        "max_reply_tokens",
        "kv_store",
    )
    actions = ["drain", "mark_down", "mark_up"]

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
class SessionAssignmentAdmin(admin.ModelAdmin):
    list_display = ("session_key", "node", "reason", "moves", "assigned_at", "moved_at")
    list_filter = ("node", "reason")
    search_fields = ("session_key",)
    list_select_related = ("node",)
    readonly_fields = ("session_key", "reason", "moves", "assigned_at", "moved_at")
    fields = ("session_key", "node", "reason", "moves", "assigned_at", "moved_at")

    def save_model(self, request, obj: SessionAssignment, form, change) -> None:
        """Moving a session here goes through the router, so loads and the move log stay right."""
        services.assignment_move(session_key=obj.session_key, node_name=obj.node.name)


@admin.register(AssignmentMove)
class AssignmentMoveAdmin(ReadOnly, admin.ModelAdmin):
    list_display = ("session_key", "from_node", "to_node", "reason", "created_at")
    list_filter = ("reason", "to_node")
    search_fields = ("session_key",)
