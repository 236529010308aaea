import secrets

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand


class Command(BaseCommand):
    help = "Create (or reset) the demo user with a fresh random password, and print the credentials."

    def add_arguments(self, parser):
        parser.add_argument("--username", default="demo", help="Login name of the demo user.")

    def handle(self, *, username: str, **options):
        password = secrets.token_urlsafe(12)
        user, created = get_user_model().objects.get_or_create(username=username)
        user.set_password(password)
        user.save(update_fields=["password"])
        verb = "created" if created else "reset"
        self.stdout.write(f"Demo user {verb}: username={username} password={password}")
