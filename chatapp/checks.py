from django.conf import settings
from django.core.checks import Error, register

from chatapp.memory.registry import strategy_errors


@register()
def memory_strategies_build(app_configs, **kwargs) -> list[Error]:
    """Every CHAT_MEMORY_STRATEGIES alias, and the default, must build at start-up."""
    errors = [Error(message, id="chatapp.E001") for message in strategy_errors()]
    if settings.CHAT_DEFAULT_STRATEGY not in settings.CHAT_MEMORY_STRATEGIES:
        errors.append(
            Error(f"CHAT_DEFAULT_STRATEGY {settings.CHAT_DEFAULT_STRATEGY!r} is not an alias.", id="chatapp.E002")
        )
    return errors
