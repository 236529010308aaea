from django.apps import AppConfig


class RouterConfig(AppConfig):
    name = "router"

    def ready(self) -> None:
        from router import checks  # noqa: F401  (registers the system check)
