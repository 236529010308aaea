from django.apps import AppConfig


class ExperimentsConfig(AppConfig):
    name = "chatapp.experiments"
    label = "experiments"
    verbose_name = "Replay experiments"
