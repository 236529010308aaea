"""Login brute-force protection: failed attempts counted in Redis per username and per client address."""

from django import forms
from django.conf import settings
from django.contrib.auth.forms import AuthenticationForm
from django.contrib.auth.views import LoginView

from chatapp.streams import client


def _keys(username: str, address: str) -> list[str]:
    return [f"login-failures:user:{username.strip().lower()[:150]}", f"login-failures:addr:{address}"]


class RateLimitedAuthenticationForm(AuthenticationForm):
    """After LOGIN_MAX_FAILURES failed attempts for a username (4x that from one address), refuse logins
    for LOGIN_LOCKOUT_SECONDS, even with the right password; a success clears the username's count."""

    def clean(self):
        username = self.data.get("username", "")
        address = self.request.META.get("REMOTE_ADDR", "") if self.request else ""
        keys = _keys(username, address)
        counts = [int(c or 0) for c in client().mget(keys)]
        # An address (many users behind one proxy) may fail more often than a single username.
        limits = [settings.LOGIN_MAX_FAILURES, 4 * settings.LOGIN_MAX_FAILURES]
        if any(count >= limit for count, limit in zip(counts, limits, strict=True)):
            minutes = max(1, settings.LOGIN_LOCKOUT_SECONDS // 60)
            raise forms.ValidationError(f"Too many failed logins. Try again in {minutes} minutes.", code="locked")
        try:
            return super().clean()
        except forms.ValidationError:
            pipe = client().pipeline()
            for key in keys:
                pipe.incr(key)
                pipe.expire(key, settings.LOGIN_LOCKOUT_SECONDS)
            pipe.execute()
            raise
        finally:
            if self.user_cache is not None:
                client().delete(keys[0])


class RateLimitedLoginView(LoginView):
    form_class = RateLimitedAuthenticationForm
