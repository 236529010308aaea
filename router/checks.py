from django.core.checks import Error, register

from router import registry


@register()
def routing_policies_build(app_configs, **kwargs) -> list[Error]:
    """Every ROUTER_POLICIES alias must build at start-up, not at the first turn."""
    return [Error(message, id="router.E001") for message in registry.check_all("ROUTER_POLICIES")]
