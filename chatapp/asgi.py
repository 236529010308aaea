import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatapp.settings")
application = get_asgi_application()

from chatapp.health import require_services  # noqa: E402  (needs settings loaded)

require_services()
