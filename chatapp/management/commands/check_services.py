from django.core.management.base import BaseCommand

from chatapp.health import require_services


class Command(BaseCommand):
    help = "Exit with one clear line if Postgres or Redis cannot be reached."
    requires_system_checks: list[str] = []

    def handle(self, **options):
        require_services()
        self.stdout.write("Postgres and Redis are reachable.")
