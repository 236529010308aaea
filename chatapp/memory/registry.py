"""Strategy aliases from `settings.CHAT_MEMORY_STRATEGIES`, built once per process."""

from typing import cast

from django.conf import settings

from chatapp.memory.base import MemoryStrategy
from router import registry

SETTING = "CHAT_MEMORY_STRATEGIES"


def strategy_get(alias: str) -> MemoryStrategy:
    """The strategy configured as `alias`; ImproperlyConfigured names a bad alias or backend."""
    return registry.build(SETTING, alias)


def strategy_options(alias: str) -> dict:
    entry = cast(dict, settings.CHAT_MEMORY_STRATEGIES[alias])
    return dict(entry.get("OPTIONS", {}))


def strategy_aliases() -> list[str]:
    return list(settings.CHAT_MEMORY_STRATEGIES)


def strategy_errors() -> list[str]:
    return registry.check_all(SETTING)
