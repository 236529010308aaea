"""Login brute-force protection on every login path (the login page, the admin, anything that calls
`authenticate()`), in the authentication backend itself, the way django-axes hooks in.

Each attempt is counted before the password is checked, per username and per client address, in one
atomic Redis step (INCR returns the count including this attempt), so parallel attempts cannot all slip
under the limit. The username is normalised as Django normalises it (NFKC), and case-folded, so a
fullwidth `demo` (U+FF44...) and `Demo` count against `demo`. A success clears the username's count and
takes itself off its address's.
"""

import logging
import unicodedata
from contextlib import suppress

import redis
from django import forms
from django.conf import settings
from django.contrib.admin.forms import AdminAuthenticationForm
from django.contrib.auth.backends import ModelBackend
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest

from chatapp.streams import client

logger = logging.getLogger(__name__)
LOCKED_MESSAGE = "Too many failed logins. Try again in {minutes} minutes."


def username_key(username: str) -> str:
    return unicodedata.normalize("NFKC", username).strip().casefold()[:150]


def _keys(username: str, request: HttpRequest | None) -> list[str]:
    address = request.META.get("REMOTE_ADDR", "") if request is not None else ""
    return [f"login-attempts:user:{username_key(username)}", f"login-attempts:addr:{address}"]


def _limits() -> list[int]:
    # An address (many users behind one proxy) may try more often than a single username.
    return [settings.LOGIN_MAX_FAILURES, 4 * settings.LOGIN_MAX_FAILURES]


def attempt_allowed(username: str, request: HttpRequest | None) -> bool:
    """Count this attempt and say whether it is within the limits, in one atomic step."""
    pipe = client().pipeline(transaction=True)
    for key in _keys(username, request):
        pipe.incr(key)
        pipe.expire(key, settings.LOGIN_LOCKOUT_SECONDS)
    try:
        counts = pipe.execute()[::2]
    except redis.RedisError as exc:  # logins go on without the limit while Redis is away
        logger.warning("login attempt not counted (%s)", exc)
        return True
    return all(count <= limit for count, limit in zip(counts, _limits(), strict=True))


class RateLimitedModelBackend(ModelBackend):
    """Django's ModelBackend behind the limiter: over the limit, even the right password is refused."""

    def authenticate(self, request, username=None, password=None, **kwargs):
        if username is None or password is None:
            return super().authenticate(request, username=username, password=password, **kwargs)
        if not attempt_allowed(username, request):
            if request is not None:
                request.login_refused = True  # read by the form, for its message
            raise PermissionDenied("too many login attempts")  # authenticate() stops at once
        user = super().authenticate(request, username=username, password=password, **kwargs)
        if user is not None:  # a success is not held against the username, nor its address
            user_key, address_key = _keys(username, request)
            pipe = client().pipeline()
            pipe.delete(user_key)
            pipe.decr(address_key)
            with suppress(redis.RedisError):
                pipe.execute()
        return user


class RateLimitedAuthenticationForm(AuthenticationForm):
    """The login form, saying so when the limiter (in the backend) refused the attempt."""

    def clean(self):
        try:
            return super().clean()
        except forms.ValidationError:
            if getattr(self.request, "login_refused", False):
                minutes = max(1, settings.LOGIN_LOCKOUT_SECONDS // 60)
                raise forms.ValidationError(LOCKED_MESSAGE.format(minutes=minutes), code="locked") from None
            raise


class RateLimitedAdminAuthenticationForm(RateLimitedAuthenticationForm, AdminAuthenticationForm):
    """The admin's login form (staff only), with the same message."""


class RateLimitedLoginView(LoginView):
    form_class = RateLimitedAuthenticationForm
