import uuid

from django.conf import settings
from django.contrib.postgres.fields import ArrayField
from django.contrib.postgres.indexes import GinIndex
from django.contrib.postgres.search import SearchVector
from django.db import models
from django.utils import timezone


class TokenIdsField(ArrayField):
    """An integer[] of token ids, written as one array literal. Django adapts an ArrayField's items one by
    one (about 6 us a token here): for a turn's 2,000-token prompt that cost more than the rest of its
    writes. `int()` keeps the literal to integers."""

    def __init__(self, **kwargs) -> None:
        super().__init__(models.IntegerField(), **kwargs)

    def deconstruct(self):
        name, path, args, kwargs = super().deconstruct()
        del kwargs["base_field"]
        return name, path, args, kwargs

    def get_db_prep_save(self, value, connection):
        if isinstance(value, list | tuple):
            return "{" + ",".join(str(int(token)) for token in value) + "}"
        return super().get_db_prep_save(value, connection)


def default_strategy() -> str:
    return settings.CHAT_DEFAULT_STRATEGY


def default_model() -> str:
    return settings.CHAT_DEFAULT_MODEL


class Conversation(models.Model):
    class Source(models.TextChoices):
        UI = "ui"
        API = "api"

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="conversations")
    title = models.CharField(max_length=200, blank=True)
    source = models.CharField(max_length=8, choices=Source.choices, default=Source.UI, db_index=True)
    # An API client's session id (X-Session-ID, `user`, or a hash of its first messages).
    api_session = models.CharField(max_length=200, blank=True, db_index=True)
    # A system prompt of this conversation's own (API clients send one); empty: settings.CHAT_SYSTEM_PROMPT.
    system_prompt = models.TextField(blank=True)
    strategy = models.CharField(
        max_length=64, default=default_strategy, help_text="Memory-assembly strategy alias (CHAT_MEMORY_STRATEGIES)."
    )
    # Options over the alias's configured OPTIONS, for this conversation only (a replay's budget sweep).
    strategy_options = models.JSONField(default=dict, blank=True)
    # The model that answers it: its turns go to the nodes serving this model (router.Node.model).
    model = models.CharField(max_length=100, default=default_model)
    # How recalled turns name the two sides ("Caroline: ..."); an imported conversation keeps its names.
    user_name = models.CharField(max_length=100, default="User")
    assistant_name = models.CharField(max_length=100, default="Assistant")
    # A branch: a copy of `branched_from`'s history before `branch_point` (a user message edited, or whose
    # reply was regenerated), continued on its own. `branch_root` is the first conversation of the family.
    branched_from = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    branch_root = models.ForeignKey("self", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    branch_point = models.ForeignKey("Message", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True, db_index=True)

    class Meta:
        ordering = ["-updated_at"]
        indexes = [models.Index(fields=["owner", "-updated_at"])]

    def __str__(self) -> str:
        return self.title or f"Conversation {self.pk}"

    @property
    def session_key(self) -> str:
        """The router's and the engine's name for the conversation."""
        return f"conversation:{self.pk}"


class Message(models.Model):
    class Role(models.TextChoices):
        SYSTEM = "system"
        USER = "user"
        ASSISTANT = "assistant"

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="messages")
    role = models.CharField(max_length=16, choices=Role.choices)
    content = models.TextField()
    # The exact ids the model generated, reused verbatim in later prompts so the node's prefix cache hits.
    token_ids = TokenIdsField(null=True, blank=True)
    # Whose vocabulary `token_ids` are in: another model's prompts re-tokenize the text instead.
    model = models.CharField(max_length=100, blank=True)
    pinned = models.BooleanField(default=False, help_text="Rides in a fixed slot after the system prompt.")
    excluded = models.BooleanField(default=False, help_text="Never resent to the model.")
    # When it was said: now, or the original time of an imported message.
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["created_at", "id"]
        indexes = [
            models.Index(fields=["conversation", "created_at", "id"]),
            GinIndex(SearchVector("content", config="english"), name="message_content_search"),
        ]

    def __str__(self) -> str:
        return f"{self.role}: {self.content[:60]}"


class Turn(models.Model):
    """One request to the model: the user message it answers and the reply it produced, with its costs."""

    class Status(models.TextChoices):
        QUEUED = "queued"
        RUNNING = "running"
        DONE = "done"
        FAILED = "failed"
        CANCELLED = "cancelled"

    FINISHED = (Status.DONE, Status.FAILED, Status.CANCELLED)
    # The exact prompt, kept for inspection (the admin, experiments): the turn's largest fields, which the
    # turn's own life never reads back.
    PROMPT_RECORD = ("prompt_text", "prompt_token_ids")

    # Names the turn's Redis stream: unlike the id, never reused (a restored or reset database reuses ids).
    public_id = models.UUIDField(default=uuid.uuid4, unique=True, editable=False)
    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="turns")
    user_message = models.OneToOneField(Message, on_delete=models.CASCADE, related_name="answered_by")
    assistant_message = models.OneToOneField(
        Message, on_delete=models.SET_NULL, null=True, blank=True, related_name="produced_by"
    )
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.QUEUED, db_index=True)
    node = models.CharField(max_length=100, blank=True, db_index=True)
    # The model asked for (the conversation's when the turn started); only its nodes run the turn.
    model = models.CharField(max_length=100, blank=True)
    # The API key the turn was asked with (none: the browser); its own limits apply (chatapp.quotas).
    api_key = models.ForeignKey("ApiKey", on_delete=models.SET_NULL, null=True, blank=True, related_name="turns")
    # The node process that claimed the current attempt: a node restarted under the same name is another
    # incarnation, and takes back what its predecessor left running.
    node_incarnation = models.CharField(max_length=32, blank=True)
    # Bumped each time the turn is sent again (its node died); an older attempt writes nothing.
    attempt = models.PositiveIntegerField(default=0)
    # The attempts before the current one, oldest first: {attempt, node, incarnation, status, error,
    # queued_at, started_at, ended_at, why}, each appended when the turn is sent again.
    earlier_attempts = models.JSONField(default=list, blank=True)
    strategy = models.CharField(max_length=64, blank=True)
    # The conversation's overrides when queued; the node records the full options it assembled with.
    strategy_options = models.JSONField(default=dict, blank=True)
    # Sampling this turn asked for (an API request's parameters) over the node's defaults.
    sampling = models.JSONField(default=dict, blank=True)
    # What the strategy resent and dropped (ids, tokens per segment), and the exact prompt, for inspection.
    trace = models.JSONField(default=dict, blank=True)
    prompt_hash = models.CharField(max_length=64, blank=True)
    prompt_text = models.TextField(blank=True)
    # The exact prompt tokens: how much of this prompt extended the previous one is measured from them.
    prompt_token_ids = TokenIdsField(null=True, blank=True)
    finish_reason = models.CharField(max_length=16, blank=True)
    error = models.TextField(blank=True)
    # What kind of failure, for API clients: generation_failed, context_length_exceeded, no_node.
    error_code = models.CharField(max_length=32, blank=True)
    prompt_tokens = models.PositiveIntegerField(null=True, blank=True)
    cached_tokens = models.PositiveIntegerField(null=True, blank=True)

    class CacheSource(models.TextChoices):
        """Where the prompt tokens the node reused came from (inference.session_cache.Residency)."""

        NONE = "none", "nothing reused"
        RESIDENT = "resident", "resident in the node's context"
        RAM = "ram", "restored from the node's RAM"
        DISK = "disk", "restored from the node's disk tier"
        OTHER_NODE = "other_node", "restored from another node's disk tier"
        SHARED = "shared", "copied from another session's cached prefix"

    cache_source = models.CharField(max_length=16, choices=CacheSource.choices, default=CacheSource.NONE)
    completion_tokens = models.PositiveIntegerField(null=True, blank=True)
    # Waiting in the node's Celery queue plus waiting for a place in the engine's batch.
    queue_ms = models.FloatField(null=True, blank=True)
    prefill_ms = models.FloatField(null=True, blank=True)
    ttft_ms = models.FloatField(null=True, blank=True)
    decode_tokens_per_s = models.FloatField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    # When its current attempt was queued: a turn queued long ago on an idle node lost its task.
    queued_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["created_at", "id"]
        permissions = [("unlimited_use", "Is not held to the fair-use turn limits (replays, load tests)")]
        # The unfinished turns, by node: a few among all ever written. Every turn's start counts its node's
        # queue and its user's replies in progress, and every heartbeat looks for orphans, among these only
        # (a query excluding the FINISHED statuses, named here as the Meta cannot see them, matches the
        # condition, also as a prepared statement).
        indexes = [
            models.Index(
                fields=["node"],
                condition=~models.Q(status__in=["done", "failed", "cancelled"]),
                name="turn_unfinished_by_node",
            )
        ]

    def __str__(self) -> str:
        return f"Turn {self.pk} ({self.status})"

    @property
    def computed_tokens(self) -> int | None:
        """Prompt tokens the node had to compute (not found in its cache)."""
        if self.prompt_tokens is None or self.cached_tokens is None:
            return None
        return self.prompt_tokens - self.cached_tokens

    @property
    def template_tokens(self) -> int | None:
        """Prompt tokens of the template's own (BOS, markers, a default system prompt), beside the segments."""
        if self.prompt_tokens is None or "tokens" not in self.trace:
            return None
        return self.prompt_tokens - self.trace["tokens"]

    @property
    def stream_name(self) -> str:
        return str(self.public_id)

    @property
    def is_finished(self) -> bool:
        return self.status in self.FINISHED


class UserFact(models.Model):
    """Something the user asked to be remembered; strategies with `pinned` resend it every turn."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="facts")
    text = models.CharField(max_length=500)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["created_at", "id"]

    def __str__(self) -> str:
        return self.text[:60]


class Summary(models.Model):
    """A model-written summary of dropped turns, written after a reply (chatapp.memory.summaries); append-only,
    so prompts that include it keep their prefix until a roll-up folds it."""

    conversation = models.ForeignKey(Conversation, on_delete=models.CASCADE, related_name="summaries")
    text = models.TextField()
    # The messages it covers, first to last; a roll-up covers the summaries it folds.
    first_message = models.ForeignKey(Message, on_delete=models.CASCADE, related_name="+", null=True, blank=True)
    through_message = models.ForeignKey(Message, on_delete=models.CASCADE, related_name="+")
    # Its own cost: the summarisation is a generation too.
    prompt_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    ms = models.FloatField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["through_message_id"]
        verbose_name_plural = "summaries"

    def __str__(self) -> str:
        return f"Summary through message {self.through_message_id}"


class ApiKey(models.Model):
    """A user's key for the OpenAI-compatible API; only a hash is stored, the key is shown once."""

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True, help_text="The key's first characters, to find it.")
    hashed = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.name} ({self.prefix}...)"
