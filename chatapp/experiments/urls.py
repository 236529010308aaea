from django.urls import path

from chatapp.experiments import views

app_name = "experiments"
urlpatterns = [
    path("", views.experiment_list, name="list"),
    path("<int:experiment_id>/", views.experiment_detail, name="detail"),
    path("<int:experiment_id>/charts/<slug:name>.png", views.experiment_chart, name="chart"),
]
