"""Fair use, per user (all of a user's API keys and browser tabs together), the same for every web process.

- Unfinished turns at once: counted in Postgres under a per-user transaction lock, so parallel requests
  through any web process agree, and nothing is left counted when a process dies mid-turn.
- Tokens per minute (prompt + reply, as OpenAI counts them): a Redis counter per user and minute, which
  the node adds to when a turn finishes; a new turn is refused while the minute's count is over.
- Stored facts and pinned messages have caps, so no one can grow what every prompt carries without end.
"""

import logging
import time

import redis
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.db import connection

from chatapp.models import Conversation, Turn, UserFact
from chatapp.streams import client
from chatapp.validation import QuotaExceeded, TurnRejected

logger = logging.getLogger(__name__)
_LOCK_SPACE = 7_301  # pg_advisory_xact_lock(space, user id): this module's lock namespace
WINDOW_S = 60


UNLIMITED = "chatapp.unlimited_use"


def grant_unlimited_use(user: User) -> None:
    """Exempt an account from the turn limits: the replay's and the load test's own accounts."""
    user.user_permissions.add(Permission.objects.get(codename="unlimited_use", content_type__app_label="chatapp"))


def check_new_turn(*, user_id: int) -> None:
    """Refuse a new turn over the user's limits (QuotaExceeded says which, and when to try again). Call
    inside the transaction that stores the turn: it holds the user's lock until that commits."""
    user = User.objects.get(pk=user_id)
    if user.has_perm(UNLIMITED):
        return
    _check_running_turns(user_id=user_id)
    _check_tokens(user_id=user_id)


def _check_running_turns(*, user_id: int) -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s, %s)", [_LOCK_SPACE, user_id])
    limit = settings.CHAT_USER_MAX_RUNNING_TURNS
    running = Turn.objects.filter(conversation__owner_id=user_id).exclude(status__in=Turn.FINISHED).count()
    if running >= limit:
        raise QuotaExceeded(
            f"You have {running} replies being written; the limit is {limit} at once. Wait for one to finish.",
            retry_after=2,
        )


def _window(user_id: int, now: float) -> str:
    return f"quota:tokens:{user_id}:{int(now // WINDOW_S)}"


def _check_tokens(*, user_id: int) -> None:
    now = time.time()
    try:
        used = int(client().get(_window(user_id, now)) or 0)
    except redis.RedisError as exc:  # the limit waits for Redis; the turn does not
        logger.warning("token quota not checked (%s)", exc)
        return
    limit = settings.CHAT_USER_TOKENS_PER_MINUTE
    if used >= limit:
        raise QuotaExceeded(
            f"You have used {used:,} tokens this minute; the limit is {limit:,} a minute.",
            retry_after=int(WINDOW_S - now % WINDOW_S) + 1,
        )


def charge_tokens(*, user_id: int, tokens: int) -> None:
    """Count a finished turn's tokens against its user's current minute."""
    key = _window(user_id, time.time())
    try:
        pipe = client().pipeline()
        pipe.incrby(key, tokens)
        pipe.expire(key, 2 * WINDOW_S)
        pipe.execute()
    except redis.RedisError as exc:
        logger.warning("%d tokens not counted against user %s (%s)", tokens, user_id, exc)


def check_can_add_conversation(*, user_id: int) -> None:
    limit = settings.CHAT_USER_MAX_CONVERSATIONS
    if Conversation.objects.filter(owner_id=user_id).count() >= limit:
        raise TurnRejected(f"You have {limit:,} conversations, the most one account may keep.")


def check_can_add_fact(*, user_id: int) -> None:
    limit = settings.CHAT_USER_MAX_FACTS
    if UserFact.objects.filter(owner_id=user_id).count() >= limit:
        raise TurnRejected(f"You have {limit} saved facts, the most one account may keep; delete one first.")


def check_can_pin(*, conversation_id: int) -> None:
    limit = settings.CHAT_MAX_PINS_PER_CONVERSATION
    if Conversation.objects.get(pk=conversation_id).messages.filter(pinned=True).count() >= limit:
        raise TurnRejected(f"This conversation has {limit} pinned messages, the most it may have; unpin one first.")
