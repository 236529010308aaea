from django.contrib import admin

from chatapp.api.keys import api_key_revoke
from chatapp.models import ApiKey, Conversation, Message, Summary, Turn, UserFact

TURN_MEASUREMENTS = Turn.MEASUREMENTS


class MessageInline(admin.TabularInline):
    model = Message
    fields = ("role", "content", "pinned", "excluded", "created_at")
    readonly_fields = ("role", "content", "created_at")
    extra = 0
    can_delete = False
    show_change_link = True


class TurnInline(admin.TabularInline):
    model = Turn
    fk_name = "conversation"
    fields = ("status", "model", "node", "strategy", "finish_reason", *TURN_MEASUREMENTS, "created_at")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True


@admin.register(Conversation)
class ConversationAdmin(admin.ModelAdmin):
    list_display = ("id", "title", "owner", "source", "model", "strategy", "created_at", "updated_at")
    list_filter = ("source", "model", "strategy", "created_at")
    search_fields = ("title", "owner__username", "messages__content")
    list_select_related = ("owner",)
    raw_id_fields = ("owner",)
    inlines = [MessageInline, TurnInline]

    def get_search_results(self, request, queryset, search_term):
        queryset, _ = super().get_search_results(request, queryset, search_term)
        return queryset.distinct(), False


@admin.register(Message)
class MessageAdmin(admin.ModelAdmin):
    list_display = ("id", "conversation", "role", "short_content", "pinned", "excluded", "created_at")
    list_editable = ("pinned", "excluded")
    list_filter = ("role", "pinned", "excluded", "created_at")
    search_fields = ("content",)
    list_select_related = ("conversation",)
    raw_id_fields = ("conversation",)
    readonly_fields = ("token_ids", "model")

    @admin.display(description="content")
    def short_content(self, obj: Message) -> str:
        return obj.content[:80]


@admin.register(Turn)
class TurnAdmin(admin.ModelAdmin):
    """Read-only: a turn is written only through its transitions (chatapp.turns.lifecycle)."""

    list_display = ("id", "conversation", "status", "model", "node", "strategy", *TURN_MEASUREMENTS, "created_at")
    list_filter = ("status", "model", "node", "strategy", "cache_source", "created_at")
    search_fields = ("user_message__content", "assistant_message__content", "error")
    list_select_related = ("conversation",)
    raw_id_fields = ("conversation", "user_message", "assistant_message")
    readonly_fields = (
        *TURN_MEASUREMENTS,
        "strategy_options",
        "trace",
        "prompt_hash",
        "prompt_text",
        "prompt_token_ids",
        "attempt",
        "node_incarnation",
        "api_key",
        "error_code",
        "created_at",
        "started_at",
        "finished_at",
    )

    def has_add_permission(self, request) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


@admin.register(UserFact)
class UserFactAdmin(admin.ModelAdmin):
    list_display = ("id", "owner", "text", "created_at")
    search_fields = ("text", "owner__username")
    raw_id_fields = ("owner",)


@admin.register(Summary)
class SummaryAdmin(admin.ModelAdmin):
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
