"""Fair use, the same for every web process: per user (all of a user's API keys and browser tabs
together), and per API key (so one leaking script cannot use up its owner's share).

- Unfinished turns at once: counted in Postgres under a per-user transaction lock, so parallel requests
  through any web process agree, and nothing is left counted when a process dies mid-turn.
- Tokens per minute (prompt + reply, as OpenAI counts them): a Redis counter per user (and per key) and
  minute, which the node adds to when a turn finishes; a new turn is refused while the count is over.
- Stored facts and pinned messages have caps, so no one can grow what every prompt carries without end.
"""

import logging
import operator
import time
from functools import reduce

import redis
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.db.models import Count, Q

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


def check_new_turn(*, user_id: int, api_key_id: int | None = None) -> None:
    """Refuse a new turn over its user's or its API key's limits (QuotaExceeded says which, and when to try
    again). Call inside the transaction that stores the turn: it holds the user's lock until that commits.
    It runs before every turn's first token: one statement for an account without limits, else two and one
    read of Redis."""
    if _unlimited_else_locked(user_id):
        return
    scopes, mine = [f"user:{user_id}"], {"user": Q(conversation__owner_id=user_id)}
    if api_key_id is not None:
        scopes.append(f"key:{api_key_id}")
        mine["key"] = Q(api_key_id=api_key_id)
    unfinished = Turn.objects.exclude(status__in=Turn.FINISHED).filter(reduce(operator.or_, mine.values()))
    running = unfinished.aggregate(**{scope: Count("pk", filter=q) for scope, q in mine.items()})
    used = _tokens_used(scopes)
    _check_running(running["user"], settings.CHAT_USER_MAX_RUNNING_TURNS, "You have")
    _check_tokens(used[0], settings.CHAT_USER_TOKENS_PER_MINUTE, "You have")
    if api_key_id is not None:
        _check_running(running["key"], settings.CHAT_KEY_MAX_RUNNING_TURNS, "This key has")
        _check_tokens(used[1], settings.CHAT_KEY_TOKENS_PER_MINUTE, "This key has")


# `User.has_perm(UNLIMITED)` in one statement, and unless it holds, the user's lock in the same round trip
# (a CASE evaluates only the branch it takes). Written out: it runs for every turn, and Django took 2-4 ms of
# the web's CPU to build the permission check (with joins or with Exists), ten times the cost of sending it.
_UNLIMITED_SQL = """
WITH granted AS (
    SELECT p.id FROM auth_permission p JOIN django_content_type ct ON ct.id = p.content_type_id
    WHERE ct.app_label = %(app_label)s AND p.codename = %(codename)s
)
SELECT CASE WHEN EXISTS (
    SELECT 1 FROM auth_user u
    WHERE u.id = %(user_id)s AND u.is_active AND (
        u.is_superuser
        OR EXISTS (
            SELECT 1 FROM auth_user_user_permissions up
            WHERE up.user_id = u.id AND up.permission_id IN (SELECT id FROM granted)
        )
        OR EXISTS (
            SELECT 1 FROM auth_user_groups ug JOIN auth_group_permissions gp ON gp.group_id = ug.group_id
            WHERE ug.user_id = u.id AND gp.permission_id IN (SELECT id FROM granted)
        )
    )
) THEN true
ELSE pg_advisory_xact_lock(%(lock_space)s, %(user_id)s)::text IS NULL
END
"""


def _unlimited_else_locked(user_id: int) -> bool:
    """`User.has_perm(UNLIMITED)` as Django's ModelBackend answers it (an active superuser, or the
    permission given to the user or to one of their groups); when False, this transaction now holds the
    user's lock."""
    app_label, codename = UNLIMITED.split(".")
    with connection.cursor() as cursor:
        params: dict[str, str | int] = {"app_label": app_label, "codename": codename, "user_id": user_id}
        params["lock_space"] = _LOCK_SPACE
        cursor.execute(_UNLIMITED_SQL, params)
        return cursor.fetchone()[0]


def _check_running(running: int, limit: int, who: str) -> None:
    if running >= limit:
        raise QuotaExceeded(
            f"{who} {running} replies being written; the limit is {limit} at once. Wait for one to finish.",
            retry_after=2,
        )


def _window(scope: str, now: float) -> str:
    return f"quota:tokens:{scope}:{int(now // WINDOW_S)}"


def _tokens_used(scopes: list[str]) -> list[int]:
    """The tokens each scope used this minute; none counted while Redis is unreachable (the limit waits for
    Redis, the turn does not)."""
    now = time.time()
    try:
        return [int(n or 0) for n in client().mget([_window(scope, now) for scope in scopes])]
    except redis.RedisError as exc:
        logger.warning("token quota not checked (%s)", exc)
        return [0] * len(scopes)


def _check_tokens(used: int, limit: int, who: str) -> None:
    if used >= limit:
        now = time.time()
        raise QuotaExceeded(
            f"{who} used {used:,} tokens this minute; the limit is {limit:,} a minute.",
            retry_after=int(WINDOW_S - now % WINDOW_S) + 1,
        )


def charge_tokens(*, user_id: int, api_key_id: int | None = None, tokens: int) -> None:
    """Count a finished turn's tokens against its user's (and its key's) current minute."""
    now = time.time()
    scopes = [f"user:{user_id}"] + ([f"key:{api_key_id}"] if api_key_id is not None else [])
    try:
        pipe = client().pipeline()
        for scope in scopes:
            pipe.incrby(_window(scope, now), tokens)
            pipe.expire(_window(scope, now), 2 * WINDOW_S)
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
