"""Token ids are written as one array literal (`TokenIdsField`): they must read back exactly as any
integer[] would, through every way the app writes them, and nothing but integers gets in."""

import pytest
from django.db import transaction

from chatapp.models import Message, Turn
from tests.factories import MessageFactory

# Gemma's vocabulary goes past 262,000: ids over 16 bits must survive; so must the largest int4.
IDS = [0, 1, 2, 198, 32_767, 32_768, 262_143, 2**31 - 1]


def test_token_ids_read_back_exactly_through_create_save_update_and_bulk_create(db):
    created = MessageFactory.create(role=Message.Role.ASSISTANT, token_ids=IDS)
    assert Message.objects.get(pk=created.pk).token_ids == IDS

    created.token_ids = list(reversed(IDS))
    created.save(update_fields=["token_ids"])
    assert Message.objects.get(pk=created.pk).token_ids == list(reversed(IDS))

    Message.objects.filter(pk=created.pk).update(token_ids=(5, 6))  # a tuple, as the engine hands them over
    assert Message.objects.get(pk=created.pk).token_ids == [5, 6]

    copies = Message.objects.bulk_create(
        Message(conversation=created.conversation, role=Message.Role.ASSISTANT, content="x", token_ids=ids)
        for ids in (IDS, [], None)
    )
    assert [Message.objects.get(pk=m.pk).token_ids for m in copies] == [IDS, [], None]
    assert Message.objects.filter(token_ids=IDS).get().pk == copies[0].pk  # lookups still compare integer[]


def test_turn_prompt_ids_are_written_by_a_guarded_update(db):
    message = MessageFactory.create()
    turn = Turn.objects.create(conversation=message.conversation, user_message=message)
    assert Turn.objects.filter(pk=turn.pk).update(prompt_token_ids=IDS * 300) == 1
    assert Turn.objects.get(pk=turn.pk).prompt_token_ids == IDS * 300


@pytest.mark.parametrize("bad", [["1}"], ["1,2"], [None], ["'; DROP TABLE chatapp_turn; --"]])
def test_anything_but_integers_is_refused_before_it_is_written(db, bad):
    message = MessageFactory.create(role=Message.Role.ASSISTANT, token_ids=[7])
    with pytest.raises((ValueError, TypeError)), transaction.atomic():
        Message.objects.filter(pk=message.pk).update(token_ids=bad)
    assert Message.objects.get(pk=message.pk).token_ids == [7]
