import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatapp.settings")
django_application = get_asgi_application()

from django.conf import settings  # noqa: E402  (needs settings loaded)

from chatapp.api.handler import with_api_handler  # noqa: E402
from chatapp.body_limit import BodySizeLimit  # noqa: E402
from chatapp.health import require_services  # noqa: E402
from inference.config import engine_config  # noqa: E402

require_services()
engine_config()  # a bad engine setting stops the web at start too (the API caps replies with it)
application = BodySizeLimit(with_api_handler(django_application), limit=settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
