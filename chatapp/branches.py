"""Edit and branch, and regenerate: a conversation's history up to one of its user messages, copied into a
new conversation (a branch) that continues with an edited message, or with the same one for another reply.
The original stays as it was, and the page switches between the branches of one family.

A branch is a conversation of its own, so everything that reads a conversation (assembly, the API, export,
the admin) reads a branch unchanged. Its first turn computes its prompt afresh on its node: the branch is
a new session, even where its prefix equals the original's."""

from django.db import transaction
from django.db.models import Q, QuerySet

from chatapp import services
from chatapp.models import Conversation, Message, Turn
from chatapp.turns import admission
from chatapp.validation import ReplyInProgress, TurnRejected


def conversation_branch(*, conversation: Conversation, message: Message, text: str) -> Turn:
    """A new branch of `conversation`: its messages before `message` (a user message of it), then `text`
    sent as a new turn. Nothing is stored if anything is refused (the text, a quota, no node)."""
    if message.conversation_id != conversation.pk or message.role != Message.Role.USER:
        raise TurnRejected("Only a user message of this conversation can be edited or answered again.")
    with transaction.atomic():
        source = Conversation.objects.select_for_update().get(pk=conversation.pk)
        if source.turns.exclude(status__in=Turn.FINISHED).exists():
            raise ReplyInProgress("A reply is still being written; wait for it or stop it first.")
        root = source.branch_root or source
        number = Conversation.objects.filter(branch_root=root).count() + 1
        branch = services.conversation_create(
            owner=source.owner,
            title=f"{root} (branch {number})",
            strategy=source.strategy,
            strategy_options=source.strategy_options,
            model=source.model,
        )
        for field in ("system_prompt", "user_name", "assistant_name"):
            setattr(branch, field, getattr(source, field))
        branch.branched_from, branch.branch_root, branch.branch_point = source, root, message
        branch.save()
        earlier = source.messages.filter(id__lt=message.pk).order_by("created_at", "id")
        Message.objects.bulk_create(
            Message(
                conversation=branch,
                role=m.role,
                content=m.content,
                token_ids=m.token_ids,
                model=m.model,
                pinned=m.pinned,
                excluded=m.excluded,
                created_at=m.created_at,
            )
            for m in earlier
        )
        return admission.turn_start(conversation=branch, text=text)


def conversation_family(conversation: Conversation) -> QuerySet[Conversation]:
    """The original conversation and all its branches, oldest first."""
    root = conversation.branch_root_id or conversation.pk
    return Conversation.objects.filter(Q(pk=root) | Q(branch_root_id=root)).order_by("created_at", "id")
