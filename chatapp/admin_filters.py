"""Filters that find the sessions worth an operator's look: by node, with a failed or stuck turn, with a
low cache hit, or moved by the router. Each is one subquery in the list's own query."""

from datetime import timedelta

from django.contrib import admin
from django.db.models import CharField, Exists, FloatField, OuterRef, QuerySet, Subquery, Sum, Value
from django.db.models.functions import Cast, Concat
from django.utils import timezone

from chatapp.models import Conversation, Turn
from router.models import AssignmentMove, Node

# A turn unfinished this long is stuck: the reaper fails an orphan after CHAT_ORPHAN_SECONDS, and a
# reply of MAX_REPLY_TOKENS takes a few minutes at most on these machines.
STUCK_AFTER = timedelta(minutes=5)


def cache_hit_ratio() -> Subquery:
    """Prompt tokens the nodes reused over prompt tokens sent, across a conversation's measured turns."""
    measured = Turn.objects.filter(conversation=OuterRef("pk"), prompt_tokens__gt=0).order_by()
    ratio = Cast(Sum("cached_tokens"), FloatField()) / Cast(Sum("prompt_tokens"), FloatField())
    return Subquery(measured.values("conversation").annotate(ratio=ratio).values("ratio"), output_field=FloatField())


def session_key_of_row() -> Concat:
    """`Conversation.session_key`, in SQL."""
    return Concat(Value("conversation:"), Cast(OuterRef("pk"), CharField()), output_field=CharField())


class NodeFilter(admin.SimpleListFilter):
    title = "node"
    parameter_name = "node"

    def lookups(self, request, model_admin):
        return [(name, name) for name in Node.objects.values_list("name", flat=True)]

    def queryset(self, request, queryset: QuerySet[Conversation]) -> QuerySet[Conversation]:
        if not self.value():
            return queryset
        return queryset.filter(Exists(Turn.objects.filter(conversation=OuterRef("pk"), node=self.value())))


class TroubleFilter(admin.SimpleListFilter):
    title = "turns in trouble"
    parameter_name = "trouble"

    def lookups(self, request, model_admin):
        minutes = STUCK_AFTER.total_seconds() / 60
        return [("failed", "with a failed turn"), ("stuck", f"with a turn unfinished for over {minutes:.0f} minutes")]

    def queryset(self, request, queryset: QuerySet[Conversation]) -> QuerySet[Conversation]:
        turns = Turn.objects.filter(conversation=OuterRef("pk"))
        if self.value() == "failed":
            return queryset.filter(Exists(turns.filter(status=Turn.Status.FAILED)))
        if self.value() == "stuck":
            unfinished = turns.exclude(status__in=Turn.FINISHED)
            return queryset.filter(Exists(unfinished.filter(queued_at__lt=timezone.now() - STUCK_AFTER)))
        return queryset


class CacheHitFilter(admin.SimpleListFilter):
    """On the list's `cache_hit` annotation (ConversationAdmin.get_queryset)."""

    title = "cache hit"
    parameter_name = "cache_hit_under"
    THRESHOLDS = ("0.5", "0.8", "0.9")

    def lookups(self, request, model_admin):
        return [(t, f"under {float(t):.0%}") for t in self.THRESHOLDS]

    def queryset(self, request, queryset: QuerySet[Conversation]) -> QuerySet[Conversation]:
        if self.value() not in self.THRESHOLDS:
            return queryset
        return queryset.filter(cache_hit__lt=float(self.value()))  # type: ignore[arg-type,misc]


class MovedFilter(admin.SimpleListFilter):
    title = "moved by the router"
    parameter_name = "moved"

    def lookups(self, request, model_admin):
        return [("yes", "moved"), ("no", "never moved")]

    def queryset(self, request, queryset: QuerySet[Conversation]) -> QuerySet[Conversation]:
        moved = Exists(AssignmentMove.objects.filter(session_key=session_key_of_row()))
        if self.value() == "yes":
            return queryset.filter(moved)
        if self.value() == "no":
            return queryset.filter(~moved)
        return queryset
