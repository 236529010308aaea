"""Pluggable classes configured by alias, the way Django configures CACHES and STORAGES.

`{alias: {"BACKEND": "dotted.path.Class", "OPTIONS": {...}}}` in a setting; each
alias is built once per process.
"""

from functools import cache
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver
from django.utils.module_loading import import_string


@cache
def build(setting: str, alias: str, **overrides: Any) -> Any:
    """The instance configured as `alias` in `settings.<setting>`, with `overrides` over its OPTIONS;
    ImproperlyConfigured names what is wrong."""
    configured = getattr(settings, setting)
    if alias not in configured:
        raise ImproperlyConfigured(f"{setting} has no alias {alias!r}; known: {', '.join(sorted(configured))}.")
    entry = configured[alias]
    try:
        backend = import_string(entry["BACKEND"])
    except (KeyError, ImportError) as exc:
        raise ImproperlyConfigured(f"{setting}[{alias!r}]: cannot import BACKEND {entry.get('BACKEND')!r}.") from exc
    try:
        return backend(**(entry.get("OPTIONS", {}) | overrides))
    except (TypeError, ValueError) as exc:
        raise ImproperlyConfigured(f"{setting}[{alias!r}]: bad OPTIONS: {exc}") from exc


def check_all(setting: str) -> list[str]:
    """Build every alias; the errors, one line each (for a system check)."""
    errors = []
    for alias in getattr(settings, setting):
        try:
            build(setting, alias)
        except ImproperlyConfigured as exc:
            errors.append(str(exc))
    return errors


@receiver(setting_changed)
def _settings_changed(**kwargs: Any) -> None:
    build.cache_clear()
