"""Mounted at /api/admin/workers (no trailing slash, as in the spec; a trailing slash is accepted too)."""

from django.urls import re_path

from . import views

urlpatterns = [
    re_path(r"^/?$", views.AdminWorkerListView.as_view(), name="admin-workers"),
    re_path(r"^/(?P<worker_id>[\w-]+)/?$", views.AdminWorkerDetailView.as_view(), name="admin-worker"),
    re_path(r"^/(?P<worker_id>[\w-]+)/drain/?$", views.AdminWorkerDrainView.as_view(), name="admin-worker-drain"),
    re_path(r"^/(?P<worker_id>[\w-]+)/token/?$", views.AdminWorkerTokenView.as_view(), name="admin-worker-token"),
]
