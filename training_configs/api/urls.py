from django.urls import path, re_path

from . import views

urlpatterns = [
    path("", views.ConfigListView.as_view(), name="config-list"),
    re_path(r"^/(?P<name>[^/]+)$", views.ConfigDetailView.as_view(), name="config-detail"),
]
