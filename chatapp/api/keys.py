"""API keys: shown once, stored as a SHA-256 hash, found by prefix, compared in constant time."""

import hashlib
import hmac
import secrets
from datetime import timedelta

from django.contrib.auth.models import User
from django.utils import timezone

from chatapp.models import ApiKey

KEY_PREFIX = "sk-chat-"
PREFIX_LENGTH = 16
# `last_used_at` is kept to the minute: a key in steady use costs one write a minute, not one a request.
LAST_USED_RESOLUTION = timedelta(minutes=1)


_UNUSED_HASH = "0" * 64


def _hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def api_key_create(*, owner: User, name: str) -> tuple[ApiKey, str]:
    """A new key for `owner`; returns the row and the key itself, which is never stored or shown again."""
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey.objects.create(
        owner=owner, name=name.strip()[:100] or "API key", prefix=key[:PREFIX_LENGTH], hashed=_hash(key)
    )
    return row, key


def api_key_revoke(*, key: ApiKey) -> None:
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        key.save(update_fields=["revoked_at"])


def api_key_find(key: str) -> ApiKey | None:
    """The live key (with its owner), or None for a missing, wrong or revoked key."""
    if not key.startswith(KEY_PREFIX) or len(key) > 200:
        return None
    row = ApiKey.objects.select_related("owner").filter(prefix=key[:PREFIX_LENGTH], revoked_at__isnull=True).first()
    # Compare a hash even when no row matched, so a wrong key takes as long as a wrong prefix.
    matches = hmac.compare_digest(row.hashed if row else _UNUSED_HASH, _hash(key))
    if row is None or not matches or not row.owner.is_active:
        return None
    now = timezone.now()
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION:
        ApiKey.objects.filter(pk=row.pk).update(last_used_at=now)
        row.last_used_at = now
    return row
