from django.contrib import admin, messages
from django.db.models import QuerySet
from django.http import HttpRequest
from django.template.loader import render_to_string
from django.utils.html import format_html
from django.utils.safestring import mark_safe

from chatapp import turn_inspection
from chatapp.admin_filters import CacheHitFilter, MovedFilter, NodeFilter, TroubleFilter, cache_hit_ratio
from chatapp.api.keys import api_key_revoke
from chatapp.counterfactual import cache_break, turn_counterfactual
from chatapp.models import ApiKey, Conversation, Message, Summary, Turn, UserFact
from chatapp.services import conversation_delete, message_set_flags
from chatapp.session_timeline import milliseconds, render_recent_turns, render_timeline
from chatapp.turns.lifecycle import turn_cancel, turn_retry
from chatapp.validation import NoNodeUp, TurnRejected
from router.admin import NodeAdmin, ReadOnly
from router.models import Node

# A turn's measurements as an operator reads them: counts, where reused tokens came from, rounded times.
TURN_MEASUREMENTS = (
    "prompt_tokens",
    "cached_tokens",
    "cache_source",
    "completion_tokens",
    "queue",
    "prefill",
    "first_token",
    "decode_speed",
)


class TurnTimings:
    """Display columns for a turn's timings, rounded and with units (the fields hold raw floats)."""

    @admin.display(description="queue", ordering="queue_ms")
    def queue(self, turn: Turn) -> str:
        return milliseconds(turn.queue_ms)

    @admin.display(description="prefill", ordering="prefill_ms")
    def prefill(self, turn: Turn) -> str:
        return milliseconds(turn.prefill_ms)

    @admin.display(description="time to first token", ordering="ttft_ms")
    def first_token(self, turn: Turn) -> str:
        return milliseconds(turn.ttft_ms)

    @admin.display(description="decoding", ordering="decode_tokens_per_s")
    def decode_speed(self, turn: Turn) -> str:
        return "" if turn.decode_tokens_per_s is None else f"{turn.decode_tokens_per_s:.1f} tokens/s"


class RecordInline(admin.TabularInline):
    """A conversation's runtime records, listed on its page: written by the product only."""

    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False


class MessageInline(RecordInline):
    model = Message
    fields = ("role", "content", "pinned", "excluded", "created_at")
    readonly_fields = fields  # pins and exclusions: the message list's actions


class TurnInline(TurnTimings, RecordInline):
    model = Turn
    fk_name = "conversation"
    fields = ("status", "model", "node", "strategy", "finish_reason", *TURN_MEASUREMENTS, "created_at")
    readonly_fields = fields


@admin.register(Conversation)
class ConversationAdmin(admin.ModelAdmin):
    list_display = (
        "id",
        "title",
        "owner",
        "source",
        "model",
        "strategy",
        "cache_hit",
        "branched_from",
        "created_at",
        "updated_at",
    )
    list_filter = (
        "source",
        "model",
        "strategy",
        NodeFilter,
        TroubleFilter,
        CacheHitFilter,
        MovedFilter,
        "created_at",
    )
    search_fields = ("title", "owner__username", "messages__content")
    list_select_related = ("owner", "branched_from")
    inlines = [MessageInline, TurnInline]
    # Its model and strategy change through the chat page's services (re-tokenising, checked options);
    # conversations are started by their owners, within their quotas.
    readonly_fields = (
        "owner",
        "source",
        "api_session",
        "strategy",
        "strategy_options",
        "model",
        "branched_from",
        "branch_root",
        "branch_point",
        "session_timeline",
    )

    def has_add_permission(self, request) -> bool:
        return False

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(cache_hit=cache_hit_ratio())

    @admin.display(description="cache hit", ordering="cache_hit")
    def cache_hit(self, conversation: Conversation) -> str:
        ratio = conversation.cache_hit  # type: ignore[attr-defined]
        return "" if ratio is None else f"{ratio:.0%}"

    @admin.display(description="session timeline")
    def session_timeline(self, conversation: Conversation) -> str:
        """Its turns in order, the router's moves between them, and prompt and computed tokens per turn."""
        return render_timeline(conversation) if conversation.pk else ""

    def get_search_results(self, request, queryset, search_term):
        queryset, _ = super().get_search_results(request, queryset, search_term)
        return queryset.distinct(), False

    def get_deleted_objects(self, objs, request):
        """Its turns, messages and summaries go with it through the deletion service, although they cannot
        be deleted on their own in the admin."""
        deleted, counts, _, protected = super().get_deleted_objects(objs, request)
        return deleted, counts, set(), protected

    def delete_model(self, request: HttpRequest, obj: Conversation) -> None:
        """Through the product's deletion: its running reply stops, and its session ends on its node."""
        conversation_delete(conversation=obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Conversation]) -> None:
        for conversation in queryset:
            conversation_delete(conversation=conversation)


@admin.register(Message)
class MessageAdmin(ReadOnly, admin.ModelAdmin):
    """Messages are written by the chat; pins and exclusions go through the same service as the chat page."""

    list_display = ("id", "conversation", "role", "short_content", "pinned", "excluded", "created_at")
    actions = ["pin_messages", "unpin_messages", "exclude_messages", "include_messages"]
    list_filter = ("role", "pinned", "excluded", "created_at")
    search_fields = ("content",)
    list_select_related = ("conversation",)
    raw_id_fields = ("conversation",)
    readonly_fields = ("token_ids", "model")

    @admin.display(description="content")
    def short_content(self, obj: Message) -> str:
        return obj.content[:80]

    def _flag(self, request: HttpRequest, queryset: QuerySet[Message], **flags: bool) -> None:
        for message in queryset:
            try:
                message_set_flags(message=message, **flags)
            except TurnRejected as exc:
                self.message_user(request, f"Message {message.pk}: {exc}", messages.ERROR)

    @admin.action(description="Pin: always resend")
    def pin_messages(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        self._flag(request, queryset, pinned=True)

    @admin.action(description="Unpin")
    def unpin_messages(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        self._flag(request, queryset, pinned=False)

    @admin.action(description="Exclude: never resend")
    def exclude_messages(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        self._flag(request, queryset, excluded=True)

    @admin.action(description="Include again")
    def include_messages(self, request: HttpRequest, queryset: QuerySet[Message]) -> None:
        self._flag(request, queryset, excluded=False)


@admin.register(Turn)
class TurnAdmin(ReadOnly, TurnTimings, admin.ModelAdmin):
    """Read-only: a turn is written only through its transitions (chatapp.turns.lifecycle), which the
    actions call with the product's own checks. Its page reads like the chat page's inspector."""

    list_display = ("id", "conversation", "status", "model", "node", "strategy", *TURN_MEASUREMENTS, "created_at")
    list_filter = ("status", "model", "node", "strategy", "cache_source", "created_at")
    search_fields = ("user_message__content", "assistant_message__content", "error")
    list_select_related = ("conversation",)
    fieldsets = (
        (None, {"fields": ("links", "asked", "answer", "status", "error", "finish_reason", "created_at")}),
        ("Where and how", {"fields": ("model", "node", "strategy")}),
        ("Cost", {"fields": TURN_MEASUREMENTS}),
        ("What was resent", {"fields": ("segments", "dropped", "prompt", "strategy_options", "sampling")}),
        ("What other strategies would have sent", {"fields": ("what_if",)}),
        ("Attempts", {"fields": ("attempts",)}),
        ("Raw records", {"classes": ["collapse"], "fields": ("trace", "prompt_token_ids", "prompt_hash")}),
    )
    readonly_fields = (
        "links",
        "asked",
        "answer",
        "status",
        "model",
        "node",
        "strategy",
        "finish_reason",
        "error",
        "created_at",
        *TURN_MEASUREMENTS,
        "segments",
        "dropped",
        "prompt",
        "strategy_options",
        "sampling",
        "what_if",
        "what_if_link",
        "attempts",
        "trace",
        "prompt_token_ids",
        "prompt_hash",
    )
    actions = ["cancel", "retry"]

    class Media:
        css = {"all": ["chat/admin.css"]}

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("conversation", "user_message", "assistant_message")

    @staticmethod
    def _messages(turn: Turn) -> dict[int, Message]:
        if not hasattr(turn, "_trace_messages"):
            turn._trace_messages = turn_inspection.trace_messages(turn)  # type: ignore[attr-defined]
        return turn._trace_messages  # type: ignore[attr-defined]

    @admin.display(description="see also")
    def links(self, turn: Turn) -> str:
        return turn_inspection.render_links(turn)

    @admin.display(description="user message")
    def asked(self, turn: Turn) -> str:
        return turn_inspection.render_message(turn.user_message)

    @admin.display(description="reply")
    def answer(self, turn: Turn) -> str:
        return turn_inspection.render_message(turn.assistant_message) if turn.assistant_message else ""

    @admin.display(description="segments")
    def segments(self, turn: Turn) -> str:
        return turn_inspection.render_segments(turn, self._messages(turn))

    @admin.display(description="dropped")
    def dropped(self, turn: Turn) -> str:
        return turn_inspection.render_dropped(turn, self._messages(turn))

    @admin.display(description="prompt")
    def prompt(self, turn: Turn) -> str:
        return turn_inspection.render_prompt(turn)

    def get_fieldsets(self, request: HttpRequest, obj=None):
        """The counterfactual replays the conversation once per strategy (seconds on a long one): only when
        asked for (`?what_if=1`), else a link that asks."""
        fieldsets = super().get_fieldsets(request, obj)
        if request.GET.get("what_if"):
            return fieldsets
        return [
            (title, {"fields": ("what_if_link",)}) if "what_if" in o["fields"] else (title, o) for title, o in fieldsets
        ]

    @admin.display(description="what if")
    def what_if_link(self, turn: Turn) -> str:
        return format_html('<a href="?what_if=1#what-if">{}</a>', "Replay this turn under every configured strategy")

    @admin.display(description="what if")
    def what_if(self, turn: Turn) -> str:
        """Every configured strategy's prompt for this turn, and why the cache broke (chatapp.counterfactual)."""
        if not turn.is_finished:
            return "(once the turn has ended)"
        try:
            what_if = turn_counterfactual(turn)
        except NoNodeUp as exc:
            return str(exc)
        context = {"turn": turn, "what_if": what_if, "cache_break": cache_break(turn)}
        table = mark_safe(render_to_string("chat/what_if.html", context))  # noqa: S308 -- an escaping template
        return format_html('<div id="what-if">{}</div>', table)

    @admin.display(description="attempt history")
    def attempts(self, turn: Turn) -> str:
        return turn_inspection.render_attempts(turn)

    @admin.action(description="Cancel: a queued turn at once, a running one at its next token")
    def cancel(self, request: HttpRequest, queryset: QuerySet[Turn]) -> None:
        for turn in queryset:
            turn_cancel(turn=turn)
        self.message_user(request, f"Asked {queryset.count()} turn(s) to stop; finished ones stay as they were.")

    @admin.action(description="Retry: send a failed reply again, as the chat page's Retry does")
    def retry(self, request: HttpRequest, queryset: QuerySet[Turn]) -> None:
        for turn in queryset:
            try:
                turn_retry(turn=turn)
            except TurnRejected as exc:
                self.message_user(request, f"Turn {turn.pk}: {exc}", messages.ERROR)
            else:
                self.message_user(request, f"Turn {turn.pk} sent again.", messages.SUCCESS)


@admin.register(UserFact)
class UserFactAdmin(admin.ModelAdmin):
    list_display = ("id", "owner", "text", "created_at")
    search_fields = ("text", "owner__username")
    raw_id_fields = ("owner",)


@admin.register(Summary)
class SummaryAdmin(ReadOnly, admin.ModelAdmin):
    list_display = (
        "id",
        "conversation",
        "first_message",
        "through_message",
        "prompt_tokens",
        "completion_tokens",
        "ms",
        "created_at",
    )
    search_fields = ("text",)
    raw_id_fields = ("conversation", "first_message", "through_message")


@admin.register(ApiKey)
class ApiKeyAdmin(admin.ModelAdmin):
    """Keys are made by their owners (the key is shown once); staff can see and revoke them."""

    list_display = ("name", "owner", "prefix", "created_at", "last_used_at", "revoked_at")
    list_filter = ("revoked_at",)
    search_fields = ("name", "prefix", "owner__username")
    readonly_fields = ("owner", "name", "prefix", "hashed", "created_at", "last_used_at", "revoked_at")
    actions = ["revoke"]

    def has_add_permission(self, request) -> bool:
        return False

    @admin.action(description="Revoke the selected keys")
    def revoke(self, request, queryset) -> None:
        for key in queryset:
            api_key_revoke(key=key)


class NodeWithTurnsAdmin(NodeAdmin):
    """The router's node page, with the node's recent turns: turns are chatapp's, and the router knows
    nothing of them, so chatapp extends the page."""

    fieldsets = (*NodeAdmin.fieldsets, ("Recent turns", {"fields": ("recent_turns",)}))  # type: ignore[assignment]
    readonly_fields = (*NodeAdmin.readonly_fields, "recent_turns")  # type: ignore[assignment]

    @admin.display(description="recent turns")
    def recent_turns(self, node: Node) -> str:
        return render_recent_turns(node.name)


admin.site.unregister(Node)
admin.site.register(Node, NodeWithTurnsAdmin)
