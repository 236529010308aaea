from django.core.management.base import BaseCommand, CommandError

from inference.chat_templates import UnsupportedTemplate
from inference.config import EngineConfig
from inference.model_files import PACKAGED, ModelNotFound, resolve_model
from inference.tokenizer import chat_format_for


class Command(BaseCommand):
    help = (
        "Assemble every packaged model (and MODEL_PATH's, if set) into place, check its chat template, and list them."
    )

    def handle(self, **options):
        config = EngineConfig()
        names = sorted(PACKAGED)
        files = [resolve_model(name=name) for name in names]
        try:
            if config.MODEL_PATH:
                files.append(config.model_file())
            for file in files:
                template = chat_format_for(file).template
                default = " (default)" if file == config.model_file() else ""
                size = file.path.stat().st_size / 2**20
                self.stdout.write(f"model {file.name}{default}: {file.path} ({size:.0f} MiB, {template} template)")
        except (ModelNotFound, UnsupportedTemplate) as exc:
            raise CommandError(str(exc)) from exc
