"""Reads: what a user may see, and the history a turn answers."""

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from django.contrib.auth.models import User
from django.contrib.postgres.search import SearchHeadline, SearchQuery, SearchRank, SearchVector
from django.db import connection
from django.db.models import QuerySet
from django.shortcuts import get_object_or_404
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from chatapp.models import ApiKey, Conversation, Message, Turn, UserFact


def conversation_list_for_user(*, user: User) -> QuerySet[Conversation]:
    return Conversation.objects.filter(owner=user)


@dataclass(frozen=True)
class SearchHit:
    conversation: Conversation
    excerpt: SafeString  # the best matching message's words around the match, matches in <mark>


SEARCH_HITS = 50
_MARK_START, _MARK_END = "\x02", "\x03"  # Postgres marks matches with these; escaped text gets <mark> for them


def conversation_search_for_user(*, user: User, query: str) -> list[SearchHit]:
    """The user's conversations whose messages match `query` (Postgres full-text search, on the messages'
    GIN index) or whose title contains it: best matching message first, each conversation once."""
    query = query.strip()
    if not query:
        return []
    search = SearchQuery(query, search_type="websearch", config="english")
    vector = SearchVector("content", config="english")  # the expression the index `message_content_search` holds
    matches = (
        Message.objects.annotate(document=vector)
        .filter(document=search, conversation__owner=user)
        .annotate(
            rank=SearchRank(vector, search),
            headline=SearchHeadline(
                "content", search, config="english", start_sel=_MARK_START, stop_sel=_MARK_END, max_words=20
            ),
        )
        .select_related("conversation")
        .order_by("-rank", "-id")[: SEARCH_HITS * 4]
    )
    hits: dict[int, SearchHit] = {}
    for message in matches:
        if message.conversation_id not in hits and len(hits) < SEARCH_HITS:
            hits[message.conversation_id] = SearchHit(message.conversation, _marked(message.headline))
    titled = Conversation.objects.filter(owner=user, title__icontains=query).exclude(pk__in=list(hits))
    for conversation in titled[: max(0, SEARCH_HITS - len(hits))]:
        hits[conversation.pk] = SearchHit(conversation, mark_safe(""))
    return list(hits.values())


def _marked(headline: str) -> SafeString:
    """A headline as HTML: its text escaped, its matches in <mark>."""
    return mark_safe(escape(headline).replace(_MARK_START, "<mark>").replace(_MARK_END, "</mark>"))  # noqa: S308


def conversation_get_for_user(*, user: User, conversation_id: int) -> Conversation:
    """The user's own conversation, or 404: another user's id looks exactly like a missing one."""
    return get_object_or_404(Conversation, pk=conversation_id, owner=user)


def turn_get_for_user(*, user: User, conversation_id: int, turn_id: int) -> Turn:
    return get_object_or_404(
        Turn.objects.select_related("assistant_message", "user_message"),
        pk=turn_id,
        conversation_id=conversation_id,
        conversation__owner=user,
    )


def message_get_for_user(*, user: User, conversation_id: int, message_id: int) -> Message:
    return get_object_or_404(Message, pk=message_id, conversation_id=conversation_id, conversation__owner=user)


def api_key_list_for_user(*, user: User) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(owner=user)


def api_key_get_for_user(*, user: User, key_id: int) -> ApiKey:
    return get_object_or_404(ApiKey, pk=key_id, owner=user)


def fact_list_for_user(*, user: User) -> QuerySet[UserFact]:
    return UserFact.objects.filter(owner=user)


def fact_get_for_user(*, user: User, fact_id: int) -> UserFact:
    return get_object_or_404(UserFact, pk=fact_id, owner=user)


def message_list_for_conversation(*, conversation: Conversation) -> QuerySet[Message]:
    return conversation.messages.select_related("answered_by", "produced_by").order_by("created_at", "id")


def turn_in_progress(*, conversation: Conversation) -> Turn | None:
    return conversation.turns.exclude(status__in=Turn.FINISHED).select_related("user_message").last()


def _search_words(query: str) -> str:
    """The query as an OR of its words longer than two letters (websearch syntax); "" when none."""
    return " or ".join(w for w in re.findall(r"\w+", query.lower()) if len(w) > 2)


def message_search(*, query: str, message_ids: Sequence[int]) -> list[int]:
    """Postgres full-text search: which of `message_ids` match any word of `query`, best first."""
    words = _search_words(query)
    if not words or not message_ids:
        return []
    search = SearchQuery(words, search_type="websearch", config="english")
    vector = SearchVector("content", config="english")
    return list(
        Message.objects.filter(pk__in=message_ids)
        .annotate(rank=SearchRank(vector, search))
        .filter(rank__gt=0)
        .order_by("-rank", "id")
        .values_list("pk", flat=True)
    )


def text_search(*, query: str, texts: Mapping[int, str]) -> list[int]:
    """`message_search`'s ranking over texts that are not stored (a dry-run replay): matching ids, best first."""
    words = _search_words(query)
    if not words or not texts:
        return []
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT id FROM unnest(%s::bigint[], %s::text[]) AS t(id, body),"
            " LATERAL ts_rank(to_tsvector('english', body), websearch_to_tsquery('english', %s)) AS rank"
            " WHERE rank > 0 ORDER BY rank DESC, id",
            [list(texts), list(texts.values()), words],
        )
        return [row[0] for row in cursor.fetchall()]
