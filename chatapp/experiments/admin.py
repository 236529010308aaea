"""Experiments are written by the replay command; the admin shows them, read-only."""

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from chatapp.experiments.models import Experiment, ReplayTurn, Run
from router.admin import ReadOnly


class ReadOnlyAdmin(ReadOnly, admin.ModelAdmin):
    pass


class RunInline(admin.TabularInline):
    model = Run
    fields = ("label", "strategy", "strategy_options", "policy", "started_at", "finished_at", "summary")
    readonly_fields = fields
    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False


@admin.register(Experiment)
class ExperimentAdmin(ReadOnlyAdmin):
    list_display = ("id", "name", "source", "dry_run", "created_at", "page")
    list_filter = ("source", "dry_run", "created_at")
    search_fields = ("name",)
    inlines = [RunInline]

    @admin.display(description="report")
    def page(self, obj: Experiment) -> str:
        return format_html('<a href="{}">table and charts</a>', reverse("experiments:detail", args=[obj.pk]))


@admin.register(Run)
class RunAdmin(ReadOnlyAdmin):
    list_display = ("id", "experiment", "label", "policy", "started_at", "finished_at")
    list_filter = ("strategy", "policy")
    list_select_related = ("experiment",)


@admin.register(ReplayTurn)
class ReplayTurnAdmin(ReadOnlyAdmin):
    list_display = (
        "id",
        "run",
        "session",
        "index",
        "status",
        "node",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "prefix_break",
        "ttft_ms",
        "recalled",
    )
    list_filter = ("status", "prefix_break", "recalled", "run__experiment")
    list_select_related = ("run",)
    raw_id_fields = ("run", "turn")
