"""Strategy aliases from `settings.CHAT_MEMORY_STRATEGIES`, built once per process."""

from typing import cast

from django.conf import settings

from chatapp.memory.base import MemoryStrategy
from router import registry

SETTING = "CHAT_MEMORY_STRATEGIES"


def strategy_get(alias: str, overrides: dict | None = None) -> MemoryStrategy:
    """The strategy configured as `alias`, with `overrides` over its OPTIONS (a replay's budget sweep);
    ImproperlyConfigured names a bad alias, backend or option."""
    return registry.build(SETTING, alias, **(overrides or {}))


def strategy_options(alias: str, overrides: dict | None = None) -> dict:
    entry = cast(dict, settings.CHAT_MEMORY_STRATEGIES[alias])
    return dict(entry.get("OPTIONS", {})) | (overrides or {})


def strategy_aliases() -> list[str]:
    return list(settings.CHAT_MEMORY_STRATEGIES)


def strategy_errors() -> list[str]:
    return registry.check_all(SETTING)
