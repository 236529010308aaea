from django.core.management.base import BaseCommand, CommandError

from inference.config import EngineConfig
from inference.model_files import ModelNotFound, resolve_model_path


class Command(BaseCommand):
    help = "Check MODEL_PATH, or assemble the packaged default model into its local cache, and print its path."

    def handle(self, **options):
        try:
            path = resolve_model_path(EngineConfig().MODEL_PATH)
        except ModelNotFound as exc:
            raise CommandError(str(exc)) from exc
        self.stdout.write(f"model: {path} ({path.stat().st_size / 2**20:.0f} MiB)")
