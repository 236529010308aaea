"""Reads: what a user may see, and the history a turn answers."""

from django.contrib.auth.models import User
from django.db.models import QuerySet
from django.shortcuts import get_object_or_404

from chatapp.models import Conversation, Message, Turn


def conversation_list_for_user(*, user: User) -> QuerySet[Conversation]:
    return Conversation.objects.filter(owner=user)


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


def message_list_for_conversation(*, conversation: Conversation) -> QuerySet[Message]:
    return conversation.messages.select_related("answered_by", "produced_by").order_by("created_at", "id")


def turn_in_progress(*, conversation: Conversation) -> Turn | None:
    return conversation.turns.exclude(status__in=Turn.FINISHED).select_related("user_message").last()


def history_for_turn(turn: Turn) -> QuerySet[Message]:
    """Every message of the conversation up to and including the one this turn answers."""
    return Message.objects.filter(conversation_id=turn.conversation_id, id__lte=turn.user_message_id).order_by(
        "created_at", "id"
    )
