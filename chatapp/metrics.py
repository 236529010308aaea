"""Prometheus metrics for the whole stack, from any web process: `/metrics`.

Nothing is kept in one process's memory, so the figures are the same whichever uvicorn worker is
scraped, and every node is in them:
- nodes: their last heartbeat's stats and totals (inference.engine_metrics), from Postgres;
- router: assignments per node and moves by reason, from Postgres;
- web: turns by final status, API errors by code and open event streams, counted in one Redis hash by
  every web process and node (a count that cannot reach Redis is dropped, never an error for the user).
"""

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Iterator

import redis
from django.db.models import Count
from django.http import HttpRequest, HttpResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from chatapp import streams
from router.models import AssignmentMove, Node, SessionAssignment
from router.services import is_healthy

logger = logging.getLogger(__name__)
COUNTERS_KEY = "metrics:counters"


def count(name: str, label: str, by: int = 1) -> None:
    """Add `by` to the shared counter `name` with `label` (turns_total by status, api_errors_total by code;
    open_streams is counted from the event loop, by `counted_stream`)."""
    try:
        streams.client().hincrby(COUNTERS_KEY, f"{name}:{label}", by)
    except redis.RedisError as exc:
        logger.warning("metric %s{%s} not counted: %s", name, label, exc)


async def counted_stream(kind: str, events: AsyncGenerator[str]) -> AsyncIterator[str]:
    """`events`, counted as an open stream until it ends or the client goes away (then `events` is closed
    at once, so its own clean-up runs). The counts go through the event loop's own Redis client: a sync
    round trip here would stall every stream this process serves."""
    await _count_async("open_streams", kind)
    try:
        async for item in events:
            yield item
    finally:
        try:
            await events.aclose()
        finally:
            await _count_async("open_streams", kind, -1)


async def _count_async(name: str, label: str, by: int = 1) -> None:
    """`count`, from the event loop."""
    try:
        await streams.async_client().hincrby(COUNTERS_KEY, f"{name}:{label}", by)
    except redis.RedisError as exc:
        logger.warning("metric %s{%s} not counted: %s", name, label, exc)


def _shared_counters() -> dict[tuple[str, str], int]:
    try:
        raw: dict[str, str] = streams.client().hgetall(COUNTERS_KEY)  # type: ignore[assignment]
    except redis.RedisError as exc:
        logger.warning("metrics: Redis counters unavailable: %s", exc)
        return {}
    counters = {}
    for field, value in raw.items():
        name, _, label = field.partition(":")
        counters[name, label] = int(value)
    return counters


class StackCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        yield from _node_metrics(list(Node.objects.all()))
        yield from _router_metrics()
        yield from _web_metrics(_shared_counters())


def _node_metrics(nodes: list[Node]) -> Iterator[Metric]:
    gauges = {
        "up": GaugeMetricFamily("chat_node_up", "1 if the node is up and heartbeating", labels=["node", "model"]),
        "running": GaugeMetricFamily("chat_node_requests_running", "Requests in the batch", labels=["node"]),
        "waiting": GaugeMetricFamily("chat_node_requests_waiting", "Requests waiting for the batch", labels=["node"]),
        "kv_cells_used": GaugeMetricFamily("chat_node_kv_cells_used", "KV cells holding tokens", labels=["node"]),
        "kv_cells_total": GaugeMetricFamily("chat_node_kv_cells_total", "KV cells in the context", labels=["node"]),
        "sessions": GaugeMetricFamily(
            "chat_node_sessions", "Sessions held, by where (resident, spilled, disk)", labels=["node", "place"]
        ),
        "spilled_bytes": GaugeMetricFamily("chat_node_spilled_bytes", "Bytes of spilled state in RAM", labels=["node"]),
    }
    prompt = CounterMetricFamily(
        "chat_node_prompt_tokens", "Prompt tokens, computed or reused from cache", labels=["node", "kind"]
    )
    generated = CounterMetricFamily("chat_node_generated_tokens", "Tokens generated", labels=["node"])
    requests = CounterMetricFamily("chat_node_requests", "Requests finished", labels=["node"])
    steps = {
        field: CounterMetricFamily(f"chat_node_{name}", help_text, labels=["node", "kind"])
        for field, name, help_text in (
            ("steps", "steps", "Decode steps (llama_decode calls), by kind: decode or prefill"),
            ("tokens", "step_tokens", "Tokens in decode steps, by kind (decode: the running sequences of each)"),
            ("seconds", "step_seconds", "Seconds in llama_decode, by kind (its share of wall time: how busy)"),
        )
    }
    timings = {
        name: HistogramMetricFamily(f"chat_node_{name}_seconds", help_text, labels=["node"])
        for name, help_text in (
            ("queue", "Time waiting for a place in the batch"),
            ("prefill", "Time computing the prompt"),
            ("first_token", "Time from submission to the first token"),
        )
    }
    for node in nodes:
        stats, name = node.stats, node.name
        gauges["up"].add_metric([name, node.model], int(is_healthy(node)))
        for field in ("running", "waiting", "kv_cells_used", "kv_cells_total", "spilled_bytes"):
            gauges[field].add_metric([name], stats.get(field) or 0)
        for place in ("resident", "spilled", "disk"):
            gauges["sessions"].add_metric([name, place], stats.get(f"{place}_sessions") or 0)
        totals = stats.get("totals")
        if not totals:
            continue
        for kind in ("computed", "cached"):
            prompt.add_metric([name, kind], totals["tokens"][kind])
        generated.add_metric([name], totals["tokens"]["generated"])
        requests.add_metric([name], totals["requests"])
        for kind, step in totals.get("steps", {}).items():  # absent from a node older than session 41
            for field, counter in steps.items():
                counter.add_metric([name, kind], step[field])
        for timing, histogram in timings.items():
            recorded = totals["histograms"][timing]
            buckets = [(str(le), float(n)) for le, n in zip(recorded["le"], recorded["counts"], strict=True)]
            histogram.add_metric([name], buckets, recorded["sum"])
    yield from gauges.values()
    yield from (prompt, generated, requests, *steps.values(), *timings.values())


def _router_metrics() -> Iterator[Metric]:
    assignments = GaugeMetricFamily("chat_router_assignments", "Sessions assigned, by node", labels=["node"])
    for node, n in SessionAssignment.objects.values_list("node__name").annotate(n=Count("id")).order_by():
        assignments.add_metric([node], n)
    moves = CounterMetricFamily(
        "chat_router_moves",
        "Sessions moved to another node, by reason, what the node left held, and whether the router knew the "
        "session was cold (warm: held resident or in ram, and not cold)",
        labels=["reason", "held", "cold"],
    )
    counted = AssignmentMove.objects.values_list("reason", "held", "cold").annotate(n=Count("id")).order_by()
    for reason, held, cold, n in counted:
        moves.add_metric([reason, held, str(cold).lower()], n)
    yield from (assignments, moves)


def _web_metrics(counters: dict[tuple[str, str], int]) -> Iterator[Metric]:
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {
        "turns_total": CounterMetricFamily("chat_turns", "Turns ended, by final status", labels=["status"]),
        "api_errors_total": CounterMetricFamily("chat_api_errors", "API error responses, by code", labels=["code"]),
        "open_streams": GaugeMetricFamily("chat_open_streams", "Event streams open, by kind", labels=["kind"]),
    }
    for (name, label), value in sorted(counters.items()):
        if name in families:
            families[name].add_metric([label], value)
    yield from families.values()


_REGISTRY = CollectorRegistry(auto_describe=False)
_REGISTRY.register(StackCollector())


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus text format (a few queries and one Redis read per scrape)."""
    return HttpResponse(generate_latest(_REGISTRY), content_type=CONTENT_TYPE_LATEST)
