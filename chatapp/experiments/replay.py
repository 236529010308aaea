"""Driving an experiment's sessions through one run's strategy.

Live: each session becomes a real conversation, and each of its user messages
goes through `admission.turn_start` to the router and a node, exactly as a
person's would; the replay waits on the turn's stream and records what it cost.
Dry: the same strategy assembles the same history with the vocabulary-only
tokenizer and no model; the recorded replies stand in for the model's, and
`cached_tokens` is what a perfect cache would reuse.
"""

import itertools
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from django.contrib.auth.models import User
from django.db import close_old_connections, connection
from django.utils import timezone

from chatapp import quotas, services, streams
from chatapp.experiments.model_free import ModelFreeSession
from chatapp.experiments.models import ReplayTurn, Run
from chatapp.experiments.probes import recalled
from chatapp.experiments.sources import ReplaySession
from chatapp.memory.base import MemoryStrategy, StoredMessage
from chatapp.memory.registry import strategy_get
from chatapp.models import Turn
from chatapp.turns import admission, lifecycle
from chatapp.validation import NodeBusy, TurnRejected
from inference.config import EngineConfig
from inference.model_files import resolve_model
from inference.session_cache import common_prefix
from inference.tokenizer import chat_format_for

Progress = Callable[[], None]
TURN_TIMEOUT_S = 600
BUSY_GIVE_UP_S = 300


@dataclass(frozen=True)
class RunSpec:
    """One `--strategies` entry: an alias and option overrides, `alias:key=value:key=value`."""

    label: str
    strategy: str
    options: dict


def parse_strategies(text: str) -> list[RunSpec]:
    specs = []
    for label in filter(None, (part.strip() for part in text.split(","))):
        alias, *pairs = label.split(":")
        options = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ValueError(f"{label!r}: options are written key=value, as in token_budget:history_tokens=512.")
            options[key] = _option_value(value)
        services.check_strategy(alias, options)
        specs.append(RunSpec(label, alias, options))
    if not specs:
        raise ValueError("Name at least one strategy.")
    return specs


def _option_value(text: str) -> int | float | bool | str:
    if text.lower() in {"true", "false"}:
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _record(run: Run, session_index: int, session: ReplaySession, index: int, **fields) -> ReplayTurn:
    """Store one turn's figures; a probe's question is scored for recall (live runs only: a dry run has no reply)."""
    if session.probe and index == len(session.user_messages) - 1 and "turn" in fields:
        fields |= {
            "probe_distance": session.probe.distance,
            "recalled": recalled(fields["reply"], session.probe.answer),
        }
    return ReplayTurn.objects.create(run=run, session=session_index, index=index, **fields)


def _run_sessions(run: Run, sessions: Sequence[ReplaySession], worker: Callable, concurrency: int) -> None:
    """Call `worker(index, session)` for every session, `concurrency` at a time (in this thread when 1);
    the run's times are stored. The first error is raised here."""
    run.started_at = timezone.now()
    run.save(update_fields=["started_at"])
    if concurrency <= 1:
        for index, session in enumerate(sessions):
            worker(index, session)
    else:

        def in_a_thread(item: tuple[int, ReplaySession]) -> None:
            try:
                worker(*item)
            finally:
                connection.close()  # each pool thread has its own connection

        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            list(pool.map(in_a_thread, enumerate(sessions)))
    run.finished_at = timezone.now()
    run.save(update_fields=["finished_at"])


# Live ---------------------------------------------------------------------------


def replay_user() -> User:
    """Replayed conversations belong to a user of their own, who cannot log in."""
    user, created = User.objects.get_or_create(username="replay")
    if created:
        user.set_unusable_password()
        user.save(update_fields=["password"])
    quotas.grant_unlimited_use(user)
    return user


def replay_live(
    run: Run,
    sessions: Sequence[ReplaySession],
    *,
    owner: User,
    concurrency: int,
    max_tokens: int,
    seed: int,
    model: str,
    progress: Progress = lambda: None,
) -> None:
    sampling = {"max_tokens": max_tokens, "temperature": 0.0, "seed": seed}
    chat_format_for(resolve_model(name=model))  # load the vocabulary before the clock starts

    def one_session(session_index: int, session: ReplaySession) -> None:
        close_old_connections()
        conversation = services.conversation_create(
            owner=owner,
            title=f"replay {run.experiment_id}/{run.pk}: {session.key}",
            strategy=run.strategy,
            strategy_options=run.strategy_options,
            model=model,
        )
        previous: list[int] | None = None  # the previous prompt and reply, as the node's cache holds them
        for index, text in enumerate(session.user_messages):
            fields, tokens = _live_turn(conversation, text, sampling, run.policy or None, previous)
            _record(run, session_index, session, index, **fields)
            previous = tokens
            progress()

    _run_sessions(run, sessions, one_session, concurrency)


def _live_turn(conversation, text, sampling, policy, previous) -> tuple[dict, list[int] | None]:
    submitted = time.perf_counter()
    try:
        turn = _start_when_not_busy(conversation, text, sampling, policy)
    except TurnRejected as exc:
        return {"status": "rejected", "error": str(exc)}, previous
    first_token_at, event = streams.wait_finished(turn.stream_name, timeout_s=TURN_TIMEOUT_S)
    finished = time.perf_counter()
    if event is None:
        lifecycle.turn_cancel(turn=turn)
    turn.refresh_from_db()
    reply = turn.assistant_message
    prompt = turn.prompt_token_ids or []
    reusable = common_prefix(previous, prompt) if previous else 0
    fields = {
        "turn": turn,
        "status": turn.status if event else "timeout",
        "node": turn.node,
        "prompt_tokens": turn.prompt_tokens or 0,
        "cached_tokens": turn.cached_tokens or 0,
        "reusable_tokens": reusable,
        "completion_tokens": turn.completion_tokens or 0,
        "dropped_messages": len(turn.trace.get("dropped", [])),
        "prefix_break": previous is not None and reusable < len(previous),
        "ttft_ms": (first_token_at - submitted) * 1000 if first_token_at else None,
        "queue_ms": turn.queue_ms,
        "latency_ms": (finished - submitted) * 1000,
        "reply": reply.content if reply else "",
        "error": turn.error,
    }
    tokens = [*prompt, *(reply.token_ids or [])] if reply and turn.status == Turn.Status.DONE else previous
    return fields, tokens


def _start_when_not_busy(conversation, text, sampling, policy) -> Turn:
    """`turn_start`, waiting out "busy, retry" answers (a replay offers more load than the nodes take)."""
    give_up = time.monotonic() + BUSY_GIVE_UP_S
    while True:
        try:
            return admission.turn_start(conversation=conversation, text=text, sampling=sampling, policy=policy)
        except NodeBusy as exc:
            if time.monotonic() > give_up:
                raise
            time.sleep(exc.retry_after)


# Dry ----------------------------------------------------------------------------


def dry_turns(strategy: MemoryStrategy, session: ReplaySession, *, max_tokens: int) -> Iterator[dict]:
    """Each turn's assembly figures (ReplayTurn fields), with the recorded replies standing in for the model's
    (and stand-in summaries, `model_free`)."""
    config = EngineConfig()
    fmt = chat_format_for(config.model_file())
    run = ModelFreeSession(strategy, fmt, budget=config.N_CTX - max_tokens - fmt.overhead)
    ids = itertools.count(1)
    for text, reply_text in zip(session.user_messages, session.replies, strict=True):
        new = StoredMessage(next(ids), "user", text)
        reply = StoredMessage(next(ids), "assistant", reply_text, tuple(fmt.text_tokens(reply_text)))
        before = len(run.previous)  # the previous prompt and reply
        turn = run.turn(new, reply)
        if turn.assembled is None:
            yield {"status": Turn.Status.FAILED, "error": turn.error, "reply": ""}
            continue
        yield {
            "status": Turn.Status.DONE,
            "prompt_tokens": len(turn.prompt),
            "cached_tokens": turn.reusable,
            "reusable_tokens": turn.reusable,
            "completion_tokens": len(reply.token_ids or ()),
            "dropped_messages": len(turn.assembled.dropped_ids),
            "prefix_break": before > 0 and turn.reusable < before,
            "reply": reply_text,
        }


def replay_dry(
    run: Run,
    sessions: Sequence[ReplaySession],
    *,
    max_tokens: int,
    progress: Progress = lambda: None,
) -> None:
    """Assembly costs without a model: `cached_tokens` is what a perfect cache would reuse."""
    strategy = strategy_get(run.strategy, run.strategy_options)

    def one_session(session_index: int, session: ReplaySession) -> None:
        for index, fields in enumerate(dry_turns(strategy, session, max_tokens=max_tokens)):
            _record(run, session_index, session, index, **fields)
            progress()

    _run_sessions(run, sessions, one_session, concurrency=1)
