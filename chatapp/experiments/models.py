"""Replay experiments: one Experiment runs the same sessions under several (strategy, policy) Runs, and
each Run stores one ReplayTurn per turn with what it cost and, for a probe's question, what was recalled."""

from django.db import models


class Experiment(models.Model):
    class Source(models.TextChoices):
        CHITCHAT = "chitchat"
        JSONL = "jsonl"
        PROBES = "probes"

    name = models.CharField(max_length=200)
    source = models.CharField(max_length=16, choices=Source.choices)
    source_path = models.CharField(max_length=500, blank=True)
    dry_run = models.BooleanField(default=False, help_text="Assembly costs only, counted without a model.")
    # The command's options (sessions, turns, concurrency, max tokens, seed) as given.
    params = models.JSONField(default=dict)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at", "-id"]

    def __str__(self) -> str:
        return self.name


class Run(models.Model):
    """One strategy (with its option overrides) under one routing policy, over the experiment's sessions."""

    experiment = models.ForeignKey(Experiment, on_delete=models.CASCADE, related_name="runs")
    label = models.CharField(
        max_length=200, help_text="The strategy spec as given, e.g. token_budget:history_tokens=512."
    )
    strategy = models.CharField(max_length=64)
    strategy_options = models.JSONField(default=dict, blank=True)
    policy = models.CharField(max_length=64, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # The aggregate figures (report.run_summary), stored when the run ends.
    summary = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["id"]

    def __str__(self) -> str:
        return f"{self.label} / {self.policy or 'default'}"


class ReplayTurn(models.Model):
    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="turns")
    session = models.PositiveIntegerField(help_text="The session's index in the experiment.")
    index = models.PositiveIntegerField(help_text="The turn's index in its session.")
    # The live turn it measured (none in a dry run, or once its conversation is deleted).
    turn = models.ForeignKey("chatapp.Turn", on_delete=models.SET_NULL, null=True, blank=True, related_name="+")
    status = models.CharField(max_length=16)
    node = models.CharField(max_length=100, blank=True)
    prompt_tokens = models.PositiveIntegerField(default=0)
    cached_tokens = models.PositiveIntegerField(default=0)
    # Tokens of this prompt that extend the previous prompt and reply: the most a perfect cache could reuse.
    reusable_tokens = models.PositiveIntegerField(default=0)
    completion_tokens = models.PositiveIntegerField(default=0)
    dropped_messages = models.PositiveIntegerField(default=0)
    prefix_break = models.BooleanField(default=False, help_text="The previous prompt was not reused in full.")
    ttft_ms = models.FloatField(null=True, blank=True)
    queue_ms = models.FloatField(null=True, blank=True)
    latency_ms = models.FloatField(null=True, blank=True, help_text="Submit to finished, seen by the replay.")
    reply = models.TextField(blank=True)
    # For a probe's question: the planted fact's distance (exchanges) and whether the reply recalled it.
    probe_distance = models.PositiveIntegerField(null=True, blank=True)
    recalled = models.BooleanField(null=True, blank=True)
    error = models.TextField(blank=True)

    class Meta:
        ordering = ["run", "session", "index"]
        constraints = [models.UniqueConstraint(fields=["run", "session", "index"], name="replay_turn_once")]

    def __str__(self) -> str:
        return f"run {self.run_id} session {self.session} turn {self.index}"
