from django.urls import path

from chatapp import sse, views

app_name = "chat"
urlpatterns = [
    path("", views.conversation_list, name="conversation_list"),
    path("c/new/", views.conversation_create, name="conversation_create"),
    path("c/import/", views.conversation_import, name="conversation_import"),
    path("c/<int:conversation_id>/export.json", views.conversation_export_json, name="conversation_export"),
    path("c/<int:conversation_id>/delete/", views.conversation_delete, name="conversation_delete"),
    path("c/<int:conversation_id>/", views.conversation_detail, name="conversation_detail"),
    path("c/<int:conversation_id>/send/", views.turn_create, name="turn_create"),
    path("c/<int:conversation_id>/turns/<int:turn_id>/", views.turn_detail, name="turn_detail"),
    path("c/<int:conversation_id>/turns/<int:turn_id>/cancel/", views.turn_cancel, name="turn_cancel"),
    path("c/<int:conversation_id>/turns/<int:turn_id>/retry/", views.turn_retry, name="turn_retry"),
    path("c/<int:conversation_id>/turns/<int:turn_id>/regenerate/", views.turn_regenerate, name="turn_regenerate"),
    path("c/<int:conversation_id>/turns/<int:turn_id>/what-if/", views.turn_what_if, name="turn_what_if"),
    path("c/<int:conversation_id>/turns/<int:turn_id>/events/", sse.turn_events, name="turn_events"),
    *(
        path(
            f"c/<int:conversation_id>/{setting}/",
            views.conversation_switch,
            {"setting": setting},
            name=f"conversation_{setting}",
        )
        for setting in views.SWITCHES
    ),
    path("c/<int:conversation_id>/m/<int:message_id>/flags/", views.message_flags, name="message_flags"),
    path("c/<int:conversation_id>/m/<int:message_id>/branch/", views.message_branch, name="message_branch"),
    path("keys/", views.api_key_list, name="api_key_list"),
    path("keys/<int:key_id>/revoke/", views.api_key_revoke, name="api_key_revoke"),
    path("facts/", views.fact_list, name="fact_list"),
    path("facts/<int:fact_id>/", views.fact_update, name="fact_update"),
    path("facts/<int:fact_id>/delete/", views.fact_delete, name="fact_delete"),
]
