"""The API's own Django handler: `/v1/` without the browser's middleware, and without thread hops.

Under ASGI, Django runs each hook of a `MiddlewareMixin` middleware (`process_request`,
`process_response`) through `sync_to_async`: a hop to the request's thread and back for each. The full
chain (sessions, CSRF, auth, messages, clickjacking, CSP) made about 14 hops per API request, 6 ms of the
web's CPU on this machine, and a wake-up of another thread each time, beside llama.cpp's on the same
cores. The API needs none of the browser's middleware: a bearer key authenticates it and no cookie is
read or set. It keeps what every response needs, the security headers, the HTTPS redirect and the
ALLOWED_HOSTS check, from Django's own middleware, whose hooks here run on the event loop: they only read
settings and the request and set headers.
"""

from django.core.handlers.exception import convert_exception_to_response
from django.http import HttpRequest, HttpResponseBase
from django.middleware.common import CommonMiddleware
from django.middleware.security import SecurityMiddleware
from django.utils.deprecation import MiddlewareMixin

from chatapp.request_threads import ThreadReusingHandler

API_PREFIX = "/v1/"


class _OnTheLoop(MiddlewareMixin):
    """A middleware whose hooks need no thread: run them on the event loop."""

    async def __acall__(self, request: HttpRequest) -> HttpResponseBase:
        response = self.process_request(request)  # type: ignore[attr-defined]
        response = response or await self.get_response(request)  # type: ignore[misc]
        return self.process_response(request, response)  # type: ignore[attr-defined]


class ApiSecurityMiddleware(_OnTheLoop, SecurityMiddleware):
    """HSTS, nosniff, the referrer policy and the HTTPS redirect, as for every page."""


class ApiCommonMiddleware(_OnTheLoop, CommonMiddleware):
    """The ALLOWED_HOSTS check (`request.get_host()`) and Content-Length, as for every page."""


API_MIDDLEWARE = (ApiSecurityMiddleware, ApiCommonMiddleware)  # outermost first, as settings.MIDDLEWARE


class ApiHandler(ThreadReusingHandler):
    """Django's ASGI handler (its request threads reused) with API_MIDDLEWARE instead of settings.MIDDLEWARE
    (all async, no view, template-response or exception hooks)."""

    def load_middleware(self, is_async: bool = True) -> None:
        self._view_middleware: list = []
        self._template_response_middleware: list = []
        self._exception_middleware: list = []
        handler = convert_exception_to_response(self._get_response_async)  # type: ignore[attr-defined]
        for middleware in reversed(API_MIDDLEWARE):
            handler = convert_exception_to_response(middleware(handler))
        self._middleware_chain = handler


def with_api_handler(app):
    """An ASGI application that sends HTTP requests under API_PREFIX to an `ApiHandler`, the rest to `app`."""
    api = ApiHandler()

    async def application(scope: dict, receive, send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        handler = api if scope["type"] == "http" and path.startswith(API_PREFIX) else app
        await handler(scope, receive, send)

    return application
