"""What `simulate` runs: a node's measured profile, turn shapes from the dataset, sweep points, and the
check of the simulation against a live replay."""

import random
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from functools import partial

from django.db import connection

from chatapp import services, streams
from chatapp.datasets import chitchat_conversations
from chatapp.experiments.models import Experiment, Run
from chatapp.experiments.replay import dry_turns, replay_user
from chatapp.experiments.simulator import (
    NodeProfile,
    SimSession,
    SimTurn,
    Simulation,
    sessions_from_profiles,
    think_time_s,
)
from chatapp.experiments.sources import chitchat_sessions
from chatapp.memory.registry import strategy_get
from chatapp.turns import admission
from inference.benchmark import run_parallel
from inference.chat_templates import ChatMessage
from inference.config import EngineConfig
from inference.session_cache import common_prefix
from inference.tokenizer import chat_format_for
from router.services import healthy_nodes, policy_get

COMPARED = ["cache_hit_ratio", "ttft_ms_p50", "ttft_ms_p99", "latency_ms_p50", "turns_per_s"]


def measure_node(*, colocated: int = 1, concurrency: int = 1) -> dict:
    """A node's profile, measured. The engine alone (EngineConfig's env, `colocated` nodes measuring at
    once on this machine) gives prefill speed, slots and cache size. If nodes are up, real turns through
    the services give what serving adds: dispatch time, and decode step times as served (the node's
    Python work, streaming and database writes share its cores), alone and with `concurrency`
    conversations at once."""
    from inference.benchmark import calibrate_colocated
    from inference.config import EngineConfig

    conversations = list(chitchat_conversations(min_messages=8))[:200]
    figures = calibrate_colocated(EngineConfig(), conversations, nodes=colocated) | {"colocated": colocated}
    nodes = len(healthy_nodes())
    if not nodes:
        return figures | {"dispatch_ms": 0.0, "served": False}
    alone, busy = measure_serving(concurrency=1), measure_serving(concurrency=concurrency)
    per_node = concurrency / nodes
    extra = (busy["step_ms"] - alone["step_ms"]) / (per_node - 1) if per_node > 1 else figures["step_ms_per_extra"]
    return figures | {
        "step_ms_one": alone["step_ms"],
        "step_ms_per_extra": max(0.0, extra),
        "dispatch_ms": busy["dispatch_ms"],
        "served": True,
    }


def measure_serving(*, concurrency: int, turns: int = 6) -> dict:
    """Real turns on the live nodes, `concurrency` conversations at once: the median time a turn spends
    outside the engine before its first token (routing, the database, the Celery queue, assembly) and the
    median decode step as the engine served it."""
    gaps: list[float] = []
    steps: list[float] = []

    def converse(k: int) -> None:
        conversation = services.conversation_create(owner=replay_user(), title=f"calibration {k}", strategy="window")
        for n in range(turns):
            submitted = time.perf_counter()
            turn = admission.turn_start(
                conversation=conversation,
                text=f"Hello, this is message {n} of conversation {k}.",
                sampling={"max_tokens": 32, "temperature": 0},
            )
            first_token_at, _ = streams.wait_finished(turn.stream_name, timeout_s=120)
            turn.refresh_from_db()
            if first_token_at and turn.ttft_ms is not None and turn.decode_tokens_per_s:
                gaps.append((first_token_at - submitted) * 1000 - turn.ttft_ms)
                steps.append(1000 / turn.decode_tokens_per_s)
        connection.close()

    run_parallel([partial(converse, k) for k in range(concurrency)])
    return {"dispatch_ms": statistics.median(gaps), "step_ms": statistics.median(steps)}


def turn_profiles(*, strategy: str, count: int, turns: int, max_tokens: int, rng: random.Random) -> list[list[SimTurn]]:
    """Dataset conversations as the strategy would send them: prompt, reusable prefix and reply sizes per
    turn (replies capped at `max_tokens`), with think times modelled from message lengths."""
    assembling = strategy_get(strategy)
    fmt = chat_format_for(EngineConfig().model_file())
    shared = opening(fmt.render([ChatMessage("user", text)]) for text in ("Hi", "Bye"))  # the template's own
    profiles = []
    for session in chitchat_sessions(count=count, turns=turns, seed=rng.randrange(2**31)):
        shape: list[SimTurn] = []
        for text, fields in zip(
            session.user_messages, dry_turns(assembling, session, max_tokens=max_tokens), strict=True
        ):
            if fields["status"] != "done":
                break
            think = think_time_s(rng, shape[-1].reply_tokens, text) if shape else 0.0
            reply = max(1, min(fields["completion_tokens"], max_tokens))
            shape.append(SimTurn(fields["prompt_tokens"], fields["reusable_tokens"], reply, think, shared))
        if shape:
            profiles.append(shape)
    return profiles


def opening(prompts: Iterable[Sequence[int] | None]) -> int:
    """How many first tokens these prompts all share (none if fewer than two)."""
    known = [p for p in prompts if p]
    if len(known) < 2:
        return 0
    return min(common_prefix(known[0], other) for other in known[1:])


def sweep_point(
    profile: NodeProfile,
    profiles: list[list[SimTurn]],
    *,
    policy: str,
    nodes: int,
    sessions: int,
    rate: float,
    seed: int,
    skew: float = 0.0,
) -> dict:
    started = time.perf_counter()
    workload = sessions_from_profiles(profiles, count=sessions, rate_per_s=rate * nodes, seed=seed, skew=skew)
    result = Simulation(profile=profile, nodes=nodes, policy=policy_get(policy), sessions=workload).run()
    return {"policy": policy, "sessions": sessions} | result.summary() | {"wall_s": time.perf_counter() - started}


def replayed_sessions(run: Run) -> list[SimSession]:
    """A live run's sessions as the simulator takes them: its measured prompt, reuse and reply sizes, and the
    opening its sessions' prompts share."""
    turns: dict[int, list[SimTurn]] = defaultdict(list)
    done = run.turns.filter(status="done")
    shared = opening(done.filter(index=0).exclude(turn=None).values_list("turn__prompt_token_ids", flat=True))
    for t in done.order_by("session", "index"):
        turns[t.session].append(SimTurn(t.prompt_tokens, t.reusable_tokens, max(1, t.completion_tokens), 0, shared))
    return [SimSession(f"replay:{s}", tuple(shape)) for s, shape in sorted(turns.items())]


def validate(experiment: Experiment, profile: NodeProfile) -> list[dict]:
    """For each run: the replay's measured figures against the simulation of the same sessions, on the
    same nodes, with the same concurrency and policy."""
    rows = []
    for run in experiment.runs.all():
        nodes = sorted(set(run.turns.exclude(node="").values_list("node", flat=True)))
        sessions = replayed_sessions(run)
        # A first turn that reused tokens found its node holding earlier sessions' state (an earlier run's).
        warm = run.turns.filter(status="done", index=0, cached_tokens__gt=0).exists()
        simulation = Simulation(
            profile=profile,
            nodes=nodes,
            policy=policy_get(run.policy or None),
            sessions=sessions,
            concurrency=experiment.params.get("concurrency", 1),
            held_opening=sessions[0].turns[0].shared_tokens if warm and sessions else 0,
        )
        simulated = simulation.run().summary()
        measured = run.summary
        for metric in COMPARED:
            real, predicted = measured.get(metric), simulated.get(metric)
            error = (predicted - real) / real if real and predicted is not None else None
            rows.append(
                {
                    "run": run.label,
                    "nodes": len(nodes),
                    "metric": metric,
                    "replay": real,
                    "simulated": predicted,
                    "error": error,
                }
            )
    return rows


def format_table(rows: list[dict]) -> str:
    if not rows:
        return "(nothing to show)"
    header = list(rows[0])
    cells = [[_format(row.get(key)) for key in header] for row in rows]
    widths = [max(len(h), *(len(line[i]) for line in cells)) for i, h in enumerate(header)]
    lines = [header, ["-" * w for w in widths], *cells]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)) for line in lines)


def _format(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
    return f"{value:,}" if isinstance(value, int) else str(value)
