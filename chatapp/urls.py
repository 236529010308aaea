from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import include, path

from chatapp.api.handler import API_PREFIX
from chatapp.health import healthz, readyz
from chatapp.login_limits import RateLimitedAdminAuthenticationForm, RateLimitedLoginView
from chatapp.metrics import metrics_view

admin.site.login_form = RateLimitedAdminAuthenticationForm

urlpatterns = [
    path("admin/", admin.site.urls),
    path("metrics", metrics_view, name="metrics"),
    path("healthz", healthz, name="healthz"),
    path("readyz", readyz, name="readyz"),
    path(API_PREFIX.removeprefix("/"), include("chatapp.api.urls")),
    path("experiments/", include("chatapp.experiments.urls")),
    path("login/", RateLimitedLoginView.as_view(), name="login"),
    path("logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("", include("chatapp.chat_urls")),
]
