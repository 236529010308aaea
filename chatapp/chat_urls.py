from django.urls import path

from chatapp import views

app_name = "chat"
urlpatterns = [
    path("", views.conversation_list, name="conversation_list"),
    path("c/new/", views.conversation_create, name="conversation_create"),
    path("c/<int:conversation_id>/", views.conversation_detail, name="conversation_detail"),
    path("c/<int:conversation_id>/send/", views.turn_create, name="turn_create"),
    path("c/<int:conversation_id>/turns/<int:turn_id>/", views.turn_detail, name="turn_detail"),
    path("c/<int:conversation_id>/turns/<int:turn_id>/cancel/", views.turn_cancel, name="turn_cancel"),
]
