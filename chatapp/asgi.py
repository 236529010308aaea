import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "chatapp.settings")
django.setup(set_prefix=False)  # as django.core.asgi.get_asgi_application does

from django.conf import settings  # noqa: E402  (needs settings loaded)

from chatapp.api.handler import with_api_handler  # noqa: E402
from chatapp.body_limit import BodySizeLimit  # noqa: E402
from chatapp.health import require_services  # noqa: E402
from chatapp.request_threads import ThreadReusingHandler  # noqa: E402
from inference.config import engine_config  # noqa: E402

require_services()
engine_config()  # a bad engine setting stops the web at start too (the API caps replies with it)
application = BodySizeLimit(with_api_handler(ThreadReusingHandler()), limit=settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
