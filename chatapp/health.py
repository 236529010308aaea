"""Health: fail fast at start, with one clear line, when Postgres or Redis cannot be reached; and the
probes an orchestrator polls: `/healthz` (the process answers) and `/readyz` (it can serve a turn)."""

from collections.abc import Callable

import psycopg
import redis
from django.conf import settings
from django.db import connection
from django.db.utils import DatabaseError
from django.http import HttpRequest, HttpResponse, JsonResponse

from router.services import healthy_nodes


class ServiceUnreachable(SystemExit):
    pass


def require_services() -> None:
    db = settings.DATABASES["default"]
    try:  # a connection of its own: the pool's would retry quietly for its whole timeout
        psycopg.connect(**connection.get_connection_params()).close()
    except psycopg.OperationalError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ServiceUnreachable(
            f"Postgres is not reachable at {db.get('HOST') or 'local socket'}:{db.get('PORT') or 5432} "
            f"(database {db.get('NAME')}): {first_line}"
        ) from exc
    try:
        redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        raise ServiceUnreachable(f"Redis is not reachable at {settings.REDIS_URL}: {exc}") from exc


def healthz(request: HttpRequest) -> HttpResponse:
    """The process is alive (no dependency is asked)."""
    return HttpResponse("ok\n", content_type="text/plain")


def _postgres() -> str:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")
    return "ok"


def _redis() -> str:
    redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2, socket_timeout=2).ping()
    return "ok"


def _nodes() -> str:
    up = len(healthy_nodes())
    if not up:
        raise LookupError("no inference node is up")
    return f"{up} up"


CHECKS: dict[str, Callable[[], str]] = {"postgres": _postgres, "redis": _redis, "nodes": _nodes}


def readyz(request: HttpRequest) -> JsonResponse:
    """200 when Postgres and Redis answer and at least one node is up; else 503, saying what is not."""
    results, ready = {}, True
    for name, check in CHECKS.items():
        try:
            results[name] = check()
        except (DatabaseError, redis.RedisError, LookupError) as exc:
            results[name] = f"failing: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
            ready = False
    return JsonResponse({"ready": ready, **results}, status=200 if ready else 503)
