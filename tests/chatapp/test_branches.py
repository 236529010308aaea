"""Edit-and-branch and regenerate: a branch copies the history before one user message and continues on
its own; the original is untouched; anything refused stores nothing."""

import pytest
from django.urls import reverse

from chatapp.branches import conversation_branch, conversation_family
from chatapp.models import Conversation, Message, Turn
from chatapp.turns import admission
from chatapp.validation import ReplyInProgress, TurnRejected
from tests.factories import ConversationFactory, MessageFactory


@pytest.fixture
def talk(idle_node) -> Conversation:
    conversation = ConversationFactory.create(system_prompt="Be brief.", strategy="window")
    for text, reply in (("I have a cat.", "Nice."), ("Her name is Miso.", "Cute name.")):
        MessageFactory.create(conversation=conversation, content=text)
        MessageFactory.create(
            conversation=conversation, role=Message.Role.ASSISTANT, content=reply, token_ids=[1, 2, 3], model="m"
        )
    return conversation


def _texts(conversation: Conversation) -> list[tuple[str, str]]:
    return list(conversation.messages.order_by("created_at", "id").values_list("role", "content"))


def test_editing_a_message_continues_a_copy_of_the_history_before_it(talk):
    before = _texts(talk)
    second = talk.messages.get(content="Her name is Miso.")

    turn = conversation_branch(conversation=talk, message=second, text="Her name is Tofu.")

    branch = turn.conversation
    assert branch.pk != talk.pk and turn.status == Turn.Status.QUEUED
    assert _texts(branch) == [*before[:2], ("user", "Her name is Tofu.")]
    assert (branch.branched_from, branch.branch_root, branch.branch_point) == (talk, talk, second)
    assert (branch.system_prompt, branch.strategy, branch.owner) == ("Be brief.", "window", talk.owner)
    copied = branch.messages.get(role="assistant")
    assert (copied.token_ids, copied.model) == ([1, 2, 3], "m")  # its exact tokens, for the node's prompt
    assert _texts(talk) == before  # the original is as it was
    assert list(conversation_family(branch)) == [talk, branch] == list(conversation_family(talk))


def test_regenerating_is_a_branch_with_the_same_message(talk):
    last = talk.messages.filter(role="user").last()
    turn = conversation_branch(conversation=talk, message=last, text=last.content)
    assert _texts(turn.conversation)[-1] == ("user", "Her name is Miso.")
    Turn.objects.filter(pk=turn.pk).update(status=Turn.Status.DONE)  # its reply came (no node runs here)
    again = conversation_branch(conversation=turn.conversation, message=turn.user_message, text="And a dog?")
    assert again.conversation.branch_root == talk  # one family, however deep
    assert list(conversation_family(talk)) == [talk, turn.conversation, again.conversation]
    assert [str(c) for c in conversation_family(talk)][1:] == [f"{talk} (branch 1)", f"{talk} (branch 2)"]


def test_a_refused_branch_stores_nothing(talk, other_user):
    count = Conversation.objects.count(), Message.objects.count()
    reply = talk.messages.filter(role="assistant").first()
    elsewhere = MessageFactory.create(conversation=ConversationFactory.create())
    first = talk.messages.first()
    with pytest.raises(TurnRejected, match="Only a user message"):
        conversation_branch(conversation=talk, message=reply, text="x")
    with pytest.raises(TurnRejected, match="Only a user message"):
        conversation_branch(conversation=talk, message=elsewhere, text="x")
    with pytest.raises(TurnRejected, match="The message is empty"):
        conversation_branch(conversation=talk, message=first, text=" \x00 ")
    admission.turn_start(conversation=talk, text="Still there?")
    with pytest.raises(ReplyInProgress):
        conversation_branch(conversation=talk, message=first, text="x")
    assert (Conversation.objects.count(), Message.objects.count()) == (count[0] + 1, count[1] + 2)


def test_the_page_edits_and_regenerates_only_ones_own_messages(client, talk, other_user):
    client.force_login(talk.owner)
    second = talk.messages.get(content="Her name is Miso.")
    response = client.post(reverse("chat:message_branch", args=[talk.pk, second.pk]), {"text": "Her name is Tofu."})
    branch = Conversation.objects.get(branched_from=talk)
    assert response.status_code == 302 and response["Location"] == reverse("chat:conversation_detail", args=[branch.pk])
    page = client.get(response["Location"]).content.decode()
    assert '<nav class="branches"' in page and f'<strong aria-current="page">{branch}</strong>' in page
    assert reverse("chat:conversation_detail", args=[talk.pk]) in page
    empty = client.post(reverse("chat:message_branch", args=[talk.pk, second.pk]), {"text": ""})
    assert empty.status_code == 400 and "The message is empty" in empty.content.decode()

    client.force_login(other_user)
    assert client.post(reverse("chat:message_branch", args=[talk.pk, second.pk]), {"text": "mine"}).status_code == 404
    turn = Turn.objects.get(conversation=branch)
    assert client.post(reverse("chat:turn_regenerate", args=[branch.pk, turn.pk])).status_code == 404
    assert Conversation.objects.filter(branch_root=talk).count() == 1
