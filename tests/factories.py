import factory
from django.conf import settings
from django.contrib.auth.models import User
from django.utils import timezone

from chatapp.models import Conversation, Message
from router.models import Node


class UserFactory(factory.django.DjangoModelFactory[User]):
    class Meta:
        model = User
        skip_postgeneration_save = True

    username = factory.Sequence(lambda n: f"user{n}")
    password = factory.django.Password("correct horse battery staple")


class ConversationFactory(factory.django.DjangoModelFactory[Conversation]):
    class Meta:
        model = Conversation

    owner = factory.SubFactory(UserFactory)
    title = factory.Sequence(lambda n: f"Conversation {n}")


class MessageFactory(factory.django.DjangoModelFactory[Message]):
    class Meta:
        model = Message

    conversation = factory.SubFactory(ConversationFactory)
    role = Message.Role.USER
    content = "Hello there."


class NodeFactory(factory.django.DjangoModelFactory[Node]):
    class Meta:
        model = Node

    name = factory.Sequence(lambda n: f"node{n}")
    queue = factory.LazyAttribute(lambda node: f"node.{node.name}")
    status = Node.Status.UP
    capacity = 16
    last_heartbeat = factory.LazyFunction(timezone.now)
    # As a node of the default model reports itself (its vocabulary is installed here).
    model = factory.LazyFunction(lambda: settings.CHAT_DEFAULT_MODEL)
    chat_template = "chatml"
    n_ctx = 4096
    max_reply_tokens = 256
