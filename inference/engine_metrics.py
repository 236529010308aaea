"""An engine's totals since it started, for Prometheus: tokens computed, reused and generated,
histograms of queue, prefill and first-token time, and its decode steps of each kind (how many, their
tokens, and the seconds spent in llama_decode). The node reports a snapshot in each heartbeat, and the
web's /metrics exports every node's (chatapp.metrics); a restarted node starts again from zero, which
Prometheus reads as a counter reset."""

import bisect
import threading
from typing import Any

from inference.types import STEP_KINDS, Generation, StepKind

# Upper bounds in seconds, as Prometheus buckets (the last one, +Inf, is implied).
BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TIMINGS = ("queue", "prefill", "first_token")


class EngineMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tokens = {"computed": 0, "cached": 0, "generated": 0}
        self._requests = 0
        # Per timing: observations per bucket (not cumulative; the last slot is over the largest bound), sum.
        self._buckets = {name: [0] * (len(BUCKETS_S) + 1) for name in TIMINGS}
        self._sums = dict.fromkeys(TIMINGS, 0.0)
        self._steps = {kind: {"steps": 0, "tokens": 0, "seconds": 0.0} for kind in STEP_KINDS}

    def observe(self, generation: Generation) -> None:
        """Count one finished request (the engine thread calls this once per request)."""
        seconds = {
            "queue": generation.queue_ms / 1000,
            "prefill": generation.prefill_ms / 1000,
            "first_token": generation.ttft_ms / 1000,
        }
        with self._lock:
            self._requests += 1
            self._tokens["computed"] += generation.prompt_tokens - generation.cached_tokens
            self._tokens["cached"] += generation.cached_tokens
            self._tokens["generated"] += len(generation.token_ids)
            for name, value in seconds.items():
                self._buckets[name][bisect.bisect_left(BUCKETS_S, value)] += 1
                self._sums[name] += value

    def observe_step(self, kind: StepKind, tokens: int, seconds: float) -> None:
        """Count one decoded step (the engine thread calls this once per llama_decode)."""
        with self._lock:
            step = self._steps[kind]
            step["steps"] += 1
            step["tokens"] += tokens
            step["seconds"] += seconds

    def snapshot(self) -> dict[str, Any]:
        """The totals as JSON: tokens, requests, per timing its cumulative bucket counts and sum, and per step
        kind its steps, tokens and seconds."""
        with self._lock:
            histograms = {}
            for name in TIMINGS:
                cumulative, total = [], 0
                for count in self._buckets[name]:
                    total += count
                    cumulative.append(total)
                histograms[name] = {"le": [*BUCKETS_S, "+Inf"], "counts": cumulative, "sum": self._sums[name]}
            return {
                "tokens": dict(self._tokens),
                "requests": self._requests,
                "histograms": histograms,
                "steps": {kind: dict(step) for kind, step in self._steps.items()},
            }
