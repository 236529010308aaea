"""Browser views. Every lookup is scoped to the signed-in user: another user's ids are a 404."""

from collections.abc import Callable
from contextlib import suppress

from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import redirect, render
from django.views.decorators.http import require_GET, require_POST
from django_htmx.http import reswap, retarget
from django_htmx.middleware import HtmxDetails
from redis.exceptions import RedisError

from chatapp import selectors, services, streams
from chatapp.api.keys import api_key_create
from chatapp.api.keys import api_key_revoke as api_key_revoke_service
from chatapp.branches import conversation_branch, conversation_family
from chatapp.conversation_exchange import conversation_export, parse_import
from chatapp.counterfactual import cache_break, turn_counterfactual
from chatapp.forms import ConversationForm, FactForm, MessageForm, model_choices
from chatapp.memory.registry import strategy_aliases
from chatapp.models import Conversation, Message, Turn
from chatapp.turns import admission, lifecycle
from chatapp.validation import NoNodeUp, TurnRejected, without_control_characters
from router.services import served_models


class HtmxHttpRequest(HttpRequest):
    htmx: HtmxDetails


@require_GET
@login_required
def conversation_list(request: HtmxHttpRequest) -> HttpResponse:
    """The user's conversations, newest first; with `q`, those matching it (full-text search)."""
    return _list_page(request, query=request.GET.get("q", "")[:SEARCH_CHARS])


SEARCH_CHARS = 200


def _list_page(request: HtmxHttpRequest, *, query: str = "", error: str = "", status: int = 200) -> HttpResponse:
    user = request.user
    context = {
        "conversations": selectors.conversation_list_for_user(user=user),  # type: ignore[arg-type]
        "query": query,
        "hits": selectors.conversation_search_for_user(user=user, query=query) if query else None,  # type: ignore[arg-type]
        "form": ConversationForm(),
        "error": error,
    }
    return render(request, "chat/conversation_list.html", context, status=status)


@require_POST
@login_required
def conversation_import(request: HtmxHttpRequest) -> HttpResponse:
    """A conversation from an exported JSON file (OpenAI's messages format); nothing is stored if any of it
    is refused, and the page says why."""
    upload = request.FILES.get("file")
    if upload is None:
        return _list_page(request, error="Choose a JSON file to import.", status=400)
    try:
        parsed = parse_import(upload.read())
        conversation = services.conversation_import(
            owner=request.user,  # type: ignore[arg-type]
            title=parsed.title or upload.name or "",
            messages=parsed.messages,
            system_prompt=parsed.system_prompt,
        )
    except TurnRejected as exc:
        return _list_page(request, error=f"Not imported: {exc}", status=exc.status)
    messages.success(request, f"Imported {len(parsed.messages)} messages.")
    return redirect("chat:conversation_detail", conversation_id=conversation.pk)


@require_GET
@login_required
def conversation_export_json(request: HtmxHttpRequest, conversation_id: int) -> HttpResponse:
    conversation = selectors.conversation_get_for_user(user=request.user, conversation_id=conversation_id)  # type: ignore[arg-type]
    response = JsonResponse(conversation_export(conversation), json_dumps_params={"ensure_ascii": False, "indent": 1})
    response["Content-Disposition"] = f'attachment; filename="conversation-{conversation.pk}.json"'
    return response


@require_POST
@login_required
def conversation_delete(request: HtmxHttpRequest, conversation_id: int) -> HttpResponse:
    """Delete the conversation: its reply stops, and its session ends on its node."""
    conversation = selectors.conversation_get_for_user(user=request.user, conversation_id=conversation_id)  # type: ignore[arg-type]
    title = str(conversation)
    services.conversation_delete(conversation=conversation)
    messages.success(request, f"Deleted {title}.")
    return redirect("chat:conversation_list")


@require_POST
@login_required
def conversation_create(request: HtmxHttpRequest) -> HttpResponse:
    form = ConversationForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Pick one of the listed memory strategies and models.")
        return redirect("chat:conversation_list")
    try:
        conversation = services.conversation_create(
            owner=request.user,  # type: ignore[arg-type]
            title=form.cleaned_data["title"],
            strategy=form.cleaned_data["strategy"],
            model=form.cleaned_data["model"],
        )
    except (TurnRejected, ValueError) as exc:
        messages.error(request, str(exc))
        return redirect("chat:conversation_list")
    return redirect("chat:conversation_detail", conversation_id=conversation.pk)


@require_GET
@login_required
def conversation_detail(request: HtmxHttpRequest, conversation_id: int) -> HttpResponse:
    conversation = selectors.conversation_get_for_user(user=request.user, conversation_id=conversation_id)  # type: ignore[arg-type]
    return render(request, "chat/conversation_detail.html", _chat_context(conversation))


def _chat_context(conversation: Conversation, *, form: MessageForm | None = None, error: str = "") -> dict:
    pending = selectors.turn_in_progress(conversation=conversation)
    pending_text, pending_after = "", "0-0"
    if pending:
        # Without Redis the live text is missing for a moment; the page follows the stream once it is back.
        with suppress(RedisError):
            pending_text, pending_after = streams.snapshot(pending.stream_name)
    return {
        "conversation": conversation,
        "chat_messages": selectors.message_list_for_conversation(conversation=conversation),
        "pending_turn": pending,
        "pending_text": pending_text,
        "pending_after": pending_after,
        "form": form or MessageForm(),
        "error": error,
        "strategies": strategy_aliases(),
        "branches": conversation_family(conversation)
        if conversation.branch_root_id or _has_branches(conversation)
        else [],
    } | _model_context(conversation.model)


def _has_branches(conversation: Conversation) -> bool:
    return Conversation.objects.filter(branch_root=conversation).exists()


def _model_context(model: str) -> dict:
    """The models to offer, and the context `model`'s nodes hold (0 while none is up) for the turn
    inspector's bar: one look at the node registry."""
    served = served_models()
    return {"models": model_choices(served, current=model), "n_ctx": served[model].n_ctx if model in served else 0}


@require_POST
@login_required
def turn_create(request: HtmxHttpRequest, conversation_id: int) -> HttpResponse:
    conversation = selectors.conversation_get_for_user(user=request.user, conversation_id=conversation_id)  # type: ignore[arg-type]
    form = MessageForm(request.POST)
    try:
        if not form.is_valid():
            raise TurnRejected(" ".join(str(error) for error in form.errors["text"]))
        turn = admission.turn_start(conversation=conversation, text=form.cleaned_data["text"])
    except TurnRejected as exc:
        if not request.htmx:
            messages.error(request, str(exc))
            return redirect("chat:conversation_detail", conversation_id=conversation.pk)
        context = _chat_context(conversation, form=form, error=str(exc))
        context["draft"] = without_control_characters(request.POST.get("text", ""))
        status = 422 if exc.status == 400 else exc.status  # 409, 429 (with Retry-After) and 503 say more
        response = render(request, "chat/conversation_detail.html#composer", context, status=status)
        if exc.retry_after:
            response["Retry-After"] = str(exc.retry_after)
        return reswap(retarget(response, "#composer"), "outerHTML")
    if not request.htmx:
        return redirect("chat:conversation_detail", conversation_id=conversation.pk)
    context = {
        "conversation": conversation,
        "turn": turn,
        "pending_text": "",
        "pending_after": "0-0",
        "composer_oob": True,
    }
    context.update(form=MessageForm(), pending_turn=turn)
    return render(request, "chat/conversation_detail.html#exchange", context)


@require_GET
@login_required
def turn_detail(request: HtmxHttpRequest, conversation_id: int, turn_id: int) -> HttpResponse:
    """One turn as it stands: polled by the page while the reply is being written."""
    turn = selectors.turn_get_for_user(user=request.user, conversation_id=conversation_id, turn_id=turn_id)  # type: ignore[arg-type]
    if not request.htmx:
        return redirect("chat:conversation_detail", conversation_id=conversation_id)
    pending_text, pending_after = ("", "0-0") if turn.is_finished else streams.snapshot(turn.stream_name)
    context = {
        "conversation": turn.conversation,
        "turn": turn,
        "pending_text": pending_text,
        "pending_after": pending_after,
        "form": MessageForm(),
        "pending_turn": None if turn.is_finished else turn,
        "composer_oob": turn.is_finished,
        "n_ctx": _model_context(turn.model)["n_ctx"] if turn.is_finished else 0,
    }
    return render(request, "chat/conversation_detail.html#turn", context)


@require_POST
@login_required
def turn_retry(request: HtmxHttpRequest, conversation_id: int, turn_id: int) -> HttpResponse:
    turn = selectors.turn_get_for_user(user=request.user, conversation_id=conversation_id, turn_id=turn_id)  # type: ignore[arg-type]
    try:
        lifecycle.turn_retry(turn=turn)
    except TurnRejected as exc:
        messages.error(request, str(exc))
    return redirect("chat:conversation_detail", conversation_id=conversation_id)


@require_POST
@login_required
def turn_cancel(request: HtmxHttpRequest, conversation_id: int, turn_id: int) -> HttpResponse:
    turn: Turn = selectors.turn_get_for_user(user=request.user, conversation_id=conversation_id, turn_id=turn_id)  # type: ignore[arg-type]
    lifecycle.turn_cancel(turn=turn)
    if request.htmx:
        return HttpResponse(status=204)
    return redirect("chat:conversation_detail", conversation_id=conversation_id)


@require_GET
@login_required
def turn_what_if(request: HtmxHttpRequest, conversation_id: int, turn_id: int) -> HttpResponse:
    """What every configured strategy would have sent for this turn, and why the cache broke (on demand)."""
    turn = selectors.turn_get_for_user(user=request.user, conversation_id=conversation_id, turn_id=turn_id)  # type: ignore[arg-type]
    if not turn.is_finished:
        return HttpResponse("The turn is still running.", status=409)
    try:
        what_if = turn_counterfactual(turn)
    except NoNodeUp as exc:
        return HttpResponse(str(exc), status=exc.status)
    return render(request, "chat/what_if.html", {"turn": turn, "what_if": what_if, "cache_break": cache_break(turn)})


@require_POST
@login_required
def message_branch(request: HtmxHttpRequest, conversation_id: int, message_id: int) -> HttpResponse:
    """Edit a user message: a new branch continues from it with the new text; the original stays."""
    message = selectors.message_get_for_user(user=request.user, conversation_id=conversation_id, message_id=message_id)  # type: ignore[arg-type]
    return _branch(request, message, request.POST.get("text", ""))


@require_POST
@login_required
def turn_regenerate(request: HtmxHttpRequest, conversation_id: int, turn_id: int) -> HttpResponse:
    """Another reply to the same message, in a new branch; the original reply stays in its own."""
    turn = selectors.turn_get_for_user(user=request.user, conversation_id=conversation_id, turn_id=turn_id)  # type: ignore[arg-type]
    return _branch(request, turn.user_message, turn.user_message.content)


def _branch(request: HtmxHttpRequest, message: Message, text: str) -> HttpResponse:
    try:
        turn = conversation_branch(conversation=message.conversation, message=message, text=text)
    except TurnRejected as exc:
        messages.error(request, str(exc))
        return render(request, "chat/conversation_detail.html", _chat_context(message.conversation), status=exc.status)
    return redirect("chat:conversation_detail", conversation_id=turn.conversation_id)


# What the conversation page can change: the service that changes it, and what the page then says.
SWITCHES: dict[str, tuple[Callable[..., None], str]] = {
    "strategy": (services.conversation_set_strategy, "Memory strategy: {}. It applies from the next turn."),
    "model": (services.conversation_set_model, "Model: {}. It answers from the next turn."),
    "title": (services.conversation_rename, "Renamed."),
    "system_prompt": (services.conversation_set_system_prompt, "System prompt saved. It leads the next prompt."),
}


@require_POST
@login_required
def conversation_switch(request: HtmxHttpRequest, conversation_id: int, setting: str) -> HttpResponse:
    """Switch the conversation's memory strategy or its model for the turns to come, rename it, or set its
    system prompt."""
    conversation = selectors.conversation_get_for_user(user=request.user, conversation_id=conversation_id)  # type: ignore[arg-type]
    switch, said = SWITCHES[setting]
    try:
        switch(conversation=conversation, **{setting: request.POST.get(setting, "")})
    except ValueError as exc:  # nothing changed: the page again, saying why
        messages.error(request, str(exc))
        conversation.refresh_from_db()
        return render(request, "chat/conversation_detail.html", _chat_context(conversation), status=400)
    messages.success(request, said.format(getattr(conversation, setting)))
    return redirect("chat:conversation_detail", conversation_id=conversation.pk)


FLAG_ACTIONS = {
    "pin": {"pinned": True},
    "unpin": {"pinned": False},
    "exclude": {"excluded": True},
    "include": {"excluded": False},
}


@require_POST
@login_required
def message_flags(request: HtmxHttpRequest, conversation_id: int, message_id: int) -> HttpResponse:
    """Pin, unpin, exclude or include a message in future prompts."""
    message = selectors.message_get_for_user(user=request.user, conversation_id=conversation_id, message_id=message_id)  # type: ignore[arg-type]
    flags = FLAG_ACTIONS.get(request.POST.get("action", ""))
    if flags is None:
        return HttpResponse("Unknown action; use one of: " + ", ".join(FLAG_ACTIONS), status=400)
    try:
        services.message_set_flags(message=message, **flags)
    except TurnRejected as exc:
        return HttpResponse(str(exc), status=409)
    if request.htmx:
        return render(
            request, "chat/conversation_detail.html#message", {"message": message, "conversation": message.conversation}
        )
    return redirect("chat:conversation_detail", conversation_id=conversation_id)


@login_required
def fact_list(request: HtmxHttpRequest) -> HttpResponse:
    """The user's saved facts; POST adds one."""
    form = FactForm(request.POST or None)
    if request.method == "POST" and form.is_valid():
        try:
            services.fact_save(owner=request.user, text=form.cleaned_data["text"])  # type: ignore[arg-type]
        except TurnRejected as exc:
            messages.error(request, str(exc))
        return redirect("chat:fact_list")
    facts = selectors.fact_list_for_user(user=request.user)  # type: ignore[arg-type]
    return render(request, "chat/fact_list.html", {"facts": facts, "form": form})


@require_POST
@login_required
def fact_update(request: HtmxHttpRequest, fact_id: int) -> HttpResponse:
    fact = selectors.fact_get_for_user(user=request.user, fact_id=fact_id)  # type: ignore[arg-type]
    try:
        services.fact_save(owner=request.user, text=request.POST.get("text", ""), fact=fact)  # type: ignore[arg-type]
    except TurnRejected as exc:
        messages.error(request, str(exc))
    return redirect("chat:fact_list")


@require_POST
@login_required
def fact_delete(request: HtmxHttpRequest, fact_id: int) -> HttpResponse:
    services.fact_delete(fact=selectors.fact_get_for_user(user=request.user, fact_id=fact_id))  # type: ignore[arg-type]
    return redirect("chat:fact_list")


@login_required
def api_key_list(request: HtmxHttpRequest) -> HttpResponse:
    """The user's API keys; POST makes one and shows it this once."""
    new_key = ""
    if request.method == "POST":
        _, new_key = api_key_create(owner=request.user, name=request.POST.get("name", ""))  # type: ignore[arg-type]
    keys = selectors.api_key_list_for_user(user=request.user)  # type: ignore[arg-type]
    return render(request, "chat/api_keys.html", {"keys": keys, "new_key": new_key})


@require_POST
@login_required
def api_key_revoke(request: HtmxHttpRequest, key_id: int) -> HttpResponse:
    api_key_revoke_service(key=selectors.api_key_get_for_user(user=request.user, key_id=key_id))  # type: ignore[arg-type]
    messages.success(request, "Key revoked: it no longer works.")
    return redirect("chat:api_key_list")
