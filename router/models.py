from django.db import models


class Node(models.Model):
    """An inference node: a Celery worker consuming its own queue, registered by itself at start."""

    class Status(models.TextChoices):
        UP = "up"
        DRAINING = "draining"  # keeps its sessions' running turns, takes no new sessions
        DOWN = "down"  # shut down, or marked down by an operator
        UNRESPONSIVE = "unresponsive"  # missed its heartbeats; its next heartbeat brings it back up

    name = models.CharField(max_length=100, unique=True)
    queue = models.CharField(max_length=120)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.UP, db_index=True)
    capacity = models.PositiveIntegerField(default=1, help_text="Concurrent generations (MAX_CONCURRENT).")
    # The one model the node serves, as it reported at start: sessions of a conversation stay among the
    # nodes of its model, and the web checks messages against these limits, not its own environment.
    model = models.CharField(max_length=100, blank=True, db_index=True)
    model_path = models.CharField(max_length=500, blank=True, help_text="The GGUF file, on the node's machine.")
    chat_template = models.CharField(max_length=32, blank=True, help_text="Template family (gemma, chatml, llama3).")
    n_ctx = models.PositiveIntegerField(default=0, help_text="Context tokens one session can hold.")
    max_reply_tokens = models.PositiveIntegerField(default=0)
    kv_store = models.CharField(
        max_length=600,
        blank=True,
        help_text="Its KV disk tier (host:directory); nodes sharing one restore each other's sessions.",
    )
    # Sessions currently assigned here, and the engine's load from its heartbeats: what the router
    # balances (router.policies.LoadModel weighs them).
    sessions = models.IntegerField(default=0)
    work = models.FloatField(default=0.0, help_text="Requests running and waiting, smoothed over heartbeats.")
    kv_use = models.FloatField(default=0.0, help_text="Share of its KV cells in use at its last heartbeat.")
    stats = models.JSONField(default=dict, blank=True, help_text="The engine's latest NodeStats.")
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    # Which process serves under this name now (set at its start): heartbeats and claims of an earlier
    # process under the same name are told apart from it.
    incarnation = models.CharField(max_length=32, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class SessionAssignment(models.Model):
    """Which node serves a session (a conversation, or a prefix-affinity key); one row per session."""

    session_key = models.CharField(max_length=200, unique=True)
    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="assignments")
    reason = models.CharField(max_length=200)
    assigned_at = models.DateTimeField(auto_now_add=True)
    moved_at = models.DateTimeField(null=True, blank=True)
    moves = models.PositiveIntegerField(default=0)
    # Its node dropped its cached state from memory (told by the node's heartbeat): its next turn recomputes
    # its prompt wherever it runs, so the router may move it for free.
    cold = models.BooleanField(default=False)

    def __str__(self) -> str:
        return f"{self.session_key} -> {self.node_id}"


class AssignmentMove(models.Model):
    """A session that changed node, and why: each move costs a cold prefill on the new node."""

    class Held(models.TextChoices):
        """What the node it left held of the session's cached state, as its last heartbeat said."""

        RESIDENT = "resident", "resident in its context"
        RAM = "ram", "spilled to its RAM"
        DISK = "disk", "in its disk tier"
        NONE = "none", "nothing (a free move)"
        UNKNOWN = "unknown", "not known (not reported)"

    session_key = models.CharField(max_length=200, db_index=True)
    from_node = models.CharField(max_length=100)
    to_node = models.CharField(max_length=100)
    reason = models.CharField(max_length=200)
    held = models.CharField(max_length=16, choices=Held.choices, default=Held.UNKNOWN)
    # The router knew the session's cache was cold (its node dropped it, or its next prompt breaks its
    # prefix), whatever its old node still held.
    cold = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.session_key}: {self.from_node} -> {self.to_node} ({self.reason})"

    @property
    def warm(self) -> bool:
        """The session left a usable cache its old node held in memory: the move costs it that cache."""
        return not self.cold and self.held in (self.Held.RESIDENT, self.Held.RAM)


class NodeSample(models.Model):
    """A node's load at one heartbeat, kept ROUTER_NODE_HISTORY_HOURS: its KV use over time, for operators."""

    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField()
    running = models.PositiveIntegerField(default=0)
    waiting = models.PositiveIntegerField(default=0)
    kv_cells_used = models.PositiveIntegerField(default=0)
    kv_cells_total = models.PositiveIntegerField(default=0)
    resident_sessions = models.PositiveIntegerField(default=0)
    spilled_sessions = models.PositiveIntegerField(default=0)
    disk_sessions = models.PositiveIntegerField(default=0)

    class Meta:
        ordering = ["node", "at"]
        indexes = [models.Index(fields=["node", "at"])]

    def __str__(self) -> str:
        return f"{self.node_id} at {self.at:%H:%M:%S}"
