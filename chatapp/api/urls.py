from django.urls import path

from chatapp.api import views

app_name = "api"
urlpatterns = [
    path("chat/completions", views.chat_completions, name="chat_completions"),
    path("models", views.models, name="models"),
]
