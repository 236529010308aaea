"""Which stored conversation an API request continues, storing the client's resent history once.

A stateless client resends the whole history each turn. The conversation is
found by session (X-Session-ID header, else the `user` field, else a hash of the
system prompt and first user message). If the stored messages equal the
resent ones, only the new user message is added; if the resent history extends
the stored one, the missing messages are added; if it diverges (an edited or
different history), a new conversation starts from it (a branch) and the
session id points to that one from then on. A request sent again (after an
error, or a reply that restarted on another node) is answered by the turn it
started, not stored twice: the stored history is then the resent one plus
this user message and its reply.
"""

from django.contrib.auth.models import User
from django.db import transaction

from chatapp import quotas, services
from chatapp.api.errors import ApiError
from chatapp.api.parsing import ChatRequest
from chatapp.models import ApiKey, Conversation, Message, Turn
from chatapp.turns import admission, lifecycle
from chatapp.validation import (
    ContextTooSmall,
    NodeBusy,
    NoNodeUp,
    QuotaExceeded,
    ReplyInProgress,
    TurnRejected,
    check_message_text,
)
from router.services import prefix_routing_key


def api_session_key(request: ChatRequest, session_id: str | None) -> str:
    if session_id:
        return session_id_key(session_id)
    if request.user:
        return f"user:{request.user.strip()[:150]}"
    first_user = next(text for role, text in request.history if role == "user")
    return prefix_routing_key(request.system + "\x00" + first_user)


def session_id_key(session_id: str) -> str:
    """How a conversation started with an X-Session-ID header is named in `Conversation.api_session`."""
    return f"session:{session_id.strip()[:150]}"


def _normalised(role: str, text: str) -> tuple[str, str]:
    """How a message is stored: user text is cleaned like any message, assistant text is kept as sent."""
    if role == "user":
        try:
            return role, check_message_text(text)
        except TurnRejected:
            return role, ""
    return role, text


def api_turn_start(*, key: ApiKey, request: ChatRequest, session_id: str | None, strategy: str | None) -> Turn:
    """Find or branch the conversation, store what it lacks of the history, and start the turn, in one
    transaction: a request that is refused (busy, no node, over a quota, a reply in progress) stores nothing."""
    owner = key.owner
    session = api_session_key(request, session_id)
    if strategy:
        try:
            services.check_strategy(strategy)
        except ValueError as exc:
            raise ApiError(str(exc), param="X-Memory-Strategy", code="unknown_strategy") from exc
    try:
        services.check_model(request.model)
    except services.UnknownModel as exc:
        raise ApiError(str(exc), status=404, param="model", code="model_not_found") from exc
    *earlier, (_, new_text) = request.history
    wanted = [_normalised(role, text) for role, text in earlier]

    def start(reaped: bool) -> Turn:
        with transaction.atomic():
            latest = _latest_conversation(owner, session)
            last_turn = admission.latest_turn(latest) if latest is not None else None
            if latest and last_turn and (again := _sent_again(latest, last_turn, request.system, wanted, new_text)):
                if not (reaped or again.is_finished):
                    raise admission.UnfinishedTurn
                return again
            conversation = _conversation(owner, session, request.system, wanted, latest)
            services.conversation_set_model(conversation=conversation, model=request.model)
            if strategy:
                services.conversation_set_strategy(conversation=conversation, strategy=strategy)
            locked = admission.Locked(latest=last_turn if conversation is latest else None, reaped=reaped)
            return admission.turn_start(
                conversation=conversation, text=new_text, sampling=request.sampling, api_key=key, locked=locked
            )

    try:
        turns = Turn.objects.filter(conversation__owner=owner, conversation__api_session=session)
        return admission.reaping_first(turns, start)
    except TurnRejected as exc:
        raise api_error(exc) from exc


def api_error(exc: TurnRejected) -> ApiError:
    """A refused turn in OpenAI's terms."""
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else {}
    if isinstance(exc, QuotaExceeded | NodeBusy):
        return ApiError(str(exc), status=429, type="rate_limit_error", code="rate_limit_exceeded", headers=headers)
    if isinstance(exc, NoNodeUp):
        return ApiError(str(exc), status=503, type="server_error", code="no_node", headers=headers)
    if isinstance(exc, ReplyInProgress):
        return ApiError(str(exc), status=409, param="messages", code="reply_in_progress")
    code = "context_length_exceeded" if isinstance(exc, ContextTooSmall) else "invalid_message"
    return ApiError(str(exc), status=exc.status, param="messages", code=code)


def _latest_conversation(owner: User, key: str) -> Conversation | None:
    return (
        Conversation.objects.select_for_update()
        .filter(owner=owner, source=Conversation.Source.API, api_session=key)
        .order_by("-id")
        .first()
    )


def _stored(conversation: Conversation, **before) -> list[tuple[str, str]]:
    messages = conversation.messages.filter(role__in=["user", "assistant"], **before)
    return list(messages.order_by("created_at", "id").values_list("role", "content"))


def _sent_again(
    conversation: Conversation, turn: Turn, system: str, wanted: list[tuple[str, str]], new_text: str
) -> Turn | None:
    """The turn this very request started, if the client sends it again: the conversation's latest turn
    (`turn`) answers the same text after the same history. A failed one is retried; a cancelled one is not
    reused."""
    if conversation.system_prompt != system or turn.status == Turn.Status.CANCELLED:
        return None
    if _normalised("user", new_text) != ("user", turn.user_message.content):
        return None
    if _stored(conversation, id__lt=turn.user_message_id) != wanted:
        return None
    if turn.status == Turn.Status.FAILED:
        lifecycle.turn_retry(turn=turn)
        turn.refresh_from_db()
    return turn


def _conversation(
    owner: User, key: str, system: str, wanted: list[tuple[str, str]], conversation: Conversation | None
) -> Conversation:
    if conversation is not None and conversation.system_prompt == system:
        stored = _stored(conversation)
        if wanted[: len(stored)] == stored:
            _store(conversation, wanted[len(stored) :])
            return conversation
    title = next((text for role, text in wanted if role == "user"), "")
    quotas.check_can_add_conversation(user_id=owner.pk)
    conversation = Conversation.objects.create(
        owner=owner,
        source=Conversation.Source.API,
        api_session=key,
        system_prompt=system,
        title=(("Branch: " if conversation else "") + title)[:60],
    )
    _store(conversation, wanted)
    return conversation


def _store(conversation: Conversation, messages: list[tuple[str, str]]) -> None:
    Message.objects.bulk_create(
        [Message(conversation=conversation, role=role, content=text) for role, text in messages if text]
    )
