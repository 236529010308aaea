"""A load test through the real stack: concurrent API clients streaming replies from the web process,
which routes them to real nodes; then a check in Postgres that nothing was lost or stored twice.

Each client is one session (X-Session-ID) resending its whole history, as OpenAI clients do; a "busy"
answer (HTTP 429) is honoured by waiting its Retry-After. The processes' memory is sampled throughout.
"""

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from django.conf import settings
from django.db.models import Count, F, Q

from chatapp.api.sessions import session_id_key
from chatapp.chat_stream_client import read_chat_stream
from chatapp.experiments.report import percentile
from chatapp.models import Conversation, Message, Turn


@dataclass
class ClientStats:
    sent: int = 0  # requests accepted (a turn was stored)
    busy: int = 0  # 429 answers
    errors: list[str] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    replies: list[str] = field(default_factory=list)


def rss_mib(pid: int) -> float | None:
    """Resident memory of a process, from /proc (None once it has exited)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def stream_one(url: str, key: str, session: str, messages: list[dict], max_tokens: int) -> tuple[int, dict]:
    """POST a streaming chat completion; (status, {"text", "ttft_ms", "retry_after", "error"})."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=600)
    body = {"model": settings.CHAT_DEFAULT_MODEL, "stream": True, "max_tokens": max_tokens, "messages": messages}
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", "X-Session-ID": session}
    started = time.perf_counter()
    try:
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        response = connection.getresponse()
        if response.status != 200:
            payload = json.loads(response.read() or b"{}")
            retry = float(response.headers.get("Retry-After") or 0)
            return response.status, {"error": payload.get("error", {}).get("message", ""), "retry_after": retry}
        reply = read_chat_stream(response, started)
        error = reply.error["message"] if reply.error else ""
        return 200, {"text": reply.text, "ttft_ms": reply.ttft_ms, "error": error}
    finally:
        connection.close()


def run_client(
    *, url: str, key: str, session: str, texts: list[str], deadline: float, max_tokens: int, stats: ClientStats
) -> None:
    """One session until `deadline`: send, stream the reply, send the next message."""
    history: list[dict] = []
    for text in texts * 100:
        if time.monotonic() >= deadline:
            return
        messages = [*history, {"role": "user", "content": text}]
        try:
            status, result = stream_one(url, key, session, messages, max_tokens)
        except OSError as exc:
            stats.errors.append(f"{session}: {exc}")
            time.sleep(1)
            continue
        if status == 429:
            stats.busy += 1
            time.sleep(result["retry_after"] or 1)
            continue
        if status != 200 or result["error"]:
            stats.errors.append(f"{session}: {status} {result['error']}")
            if status != 200:
                continue
        stats.sent += 1
        if result.get("ttft_ms") is not None:
            stats.ttft_ms.append(result["ttft_ms"])
        stats.replies.append(result["text"])
        history = [*messages, {"role": "assistant", "content": result["text"]}]


def sample_memory(pids: dict[str, int], stop: threading.Event, every_s: float = 5.0) -> dict[str, list[float]]:
    """RSS (MiB) of each named process every `every_s` seconds until `stop` is set (runs in a thread)."""
    samples: dict[str, list[float]] = {name: [] for name in pids}

    def loop() -> None:
        while not stop.is_set():
            for name, pid in pids.items():
                if (rss := rss_mib(pid)) is not None:
                    samples[name].append(rss)
            stop.wait(every_s)

    threading.Thread(target=loop, daemon=True).start()
    return samples


def wait_drained(prefix: str, timeout_s: float = 120) -> int:
    """Wait for the turns of the sessions named `prefix`... to finish; the number still unfinished after
    `timeout_s` (lost turns)."""
    deadline = time.monotonic() + timeout_s
    unfinished = Turn.objects.filter(conversation__api_session__startswith=session_id_key(prefix)).exclude(
        status__in=Turn.FINISHED
    )
    while unfinished.exists() and time.monotonic() < deadline:
        time.sleep(1)
    return unfinished.count()


def audit(prefix: str, clients: list[ClientStats]) -> dict:
    """What Postgres holds for the run against what the clients saw: lost or doubled messages."""
    conversations = Conversation.objects.filter(api_session__startswith=session_id_key(prefix))
    turns = Turn.objects.filter(conversation__in=conversations)
    messages = Message.objects.filter(conversation__in=conversations)
    accepted = sum(c.sent for c in clients)
    done = turns.filter(status=Turn.Status.DONE)
    # Resent history is matched, not stored again: each user message belongs to exactly one turn.
    doubled = conversations.annotate(
        users=Count("messages", filter=Q(messages__role="user"), distinct=True),
        turn_count=Count("turns", distinct=True),
    ).exclude(users=F("turn_count"))
    return {
        "requests_accepted": accepted,
        "turns_stored": turns.count(),
        "turns_done": done.count(),
        "turns_failed": turns.filter(status=Turn.Status.FAILED).count(),
        "replies_stored": messages.filter(role="assistant").count(),
        "replies_without_turn": messages.filter(role="assistant", produced_by__isnull=True).count(),
        "conversations_with_unmatched_messages": doubled.count(),
        "replies_differing_from_stream": _differing(done, clients),
    }


def _differing(done, clients: list[ClientStats]) -> int:
    """Streamed replies that are not, character for character, a stored reply."""
    stored: dict[str, int] = {}
    for content in done.values_list("assistant_message__content", flat=True):
        stored[content or ""] = stored.get(content or "", 0) + 1
    missing = 0
    for text in (t for c in clients for t in c.replies):
        if stored.get(text, 0):
            stored[text] -= 1
        else:
            missing += 1
    return missing


def summary(clients: list[ClientStats], seconds: float, memory: dict[str, list[float]], audit_result: dict) -> dict:
    ttfts = [t for c in clients for t in c.ttft_ms]
    return {
        "sessions": len(clients),
        "seconds": round(seconds, 1),
        "turns_per_s": round(sum(c.sent for c in clients) / seconds, 3),
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "busy_429": sum(c.busy for c in clients),
        "errors": sum(len(c.errors) for c in clients),
        "error_samples": [e for c in clients for e in c.errors][:5],
        # Resident memory at the start, each quarter of the run, and its peak: flat, or bounded by the caches.
        "memory_mib": {
            name: [round(s[min(len(s) - 1, len(s) * q // 4)]) for q in range(5)] + [round(max(s))]
            for name, s in memory.items()
            if s
        },
    } | audit_result
