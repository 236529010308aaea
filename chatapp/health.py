"""Fail fast, with one clear line, when Postgres or Redis cannot be reached."""

import redis
from django.conf import settings
from django.db import connection
from django.db.utils import OperationalError


class ServiceUnreachable(SystemExit):
    pass


def require_services() -> None:
    db = settings.DATABASES["default"]
    try:
        connection.ensure_connection()
    except OperationalError as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ServiceUnreachable(
            f"Postgres is not reachable at {db.get('HOST') or 'local socket'}:{db.get('PORT') or 5432} "
            f"(database {db.get('NAME')}): {first_line}"
        ) from exc
    try:
        redis.Redis.from_url(settings.REDIS_URL, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        raise ServiceUnreachable(f"Redis is not reachable at {settings.REDIS_URL}: {exc}") from exc
