import psycopg
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from psycopg import sql
from psycopg.conninfo import make_conninfo


class Command(BaseCommand):
    help = "Create the configured Postgres database if it does not exist yet."
    requires_system_checks: list[str] = []

    def handle(self, **options):
        db = settings.DATABASES["default"]
        params = {"dbname": "postgres", "user": db.get("USER"), "password": db.get("PASSWORD")}
        params |= {"host": db.get("HOST"), "port": db.get("PORT"), "connect_timeout": 5}
        conninfo = make_conninfo(**{key: value for key, value in params.items() if value})
        try:
            with psycopg.connect(conninfo, autocommit=True) as conn:
                exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [db["NAME"]]).fetchone()
                if not exists:
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(db["NAME"])))
        except psycopg.OperationalError as exc:
            raise CommandError(f"Postgres is not reachable at {db.get('HOST')}:{db.get('PORT')}: {exc}") from exc
        self.stdout.write(f"database {db['NAME']}: {'present' if exists else 'created'}")
