from django.conf import settings
from django.core.checks import Error, register

from chatapp.memory.registry import strategy_errors
from inference.config import BadEngineSetting, engine_config


@register()
def memory_strategies_build(app_configs, **kwargs) -> list[Error]:
    """Every CHAT_MEMORY_STRATEGIES alias, and the default, must build at start-up."""
    errors = [Error(message, id="chatapp.E001") for message in strategy_errors()]
    if settings.CHAT_DEFAULT_STRATEGY not in settings.CHAT_MEMORY_STRATEGIES:
        errors.append(
            Error(f"CHAT_DEFAULT_STRATEGY {settings.CHAT_DEFAULT_STRATEGY!r} is not an alias.", id="chatapp.E002")
        )
    return errors


@register()
def engine_settings_valid(app_configs, **kwargs) -> list[Error]:
    """The engine settings in the environment must parse and be in range (nodes run with them, and the
    API caps replies with MAX_REPLY_TOKENS)."""
    try:
        engine_config()
    except BadEngineSetting as exc:
        return [Error(str(exc), id="chatapp.E003")]
    return []
