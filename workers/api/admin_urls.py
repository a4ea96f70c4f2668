"""Mounted at /api/admin/workers (no trailing slash, as in the spec; a trailing slash is accepted too).

Actions that reach a worker's job too (rotating its token) are routed by ``job_queue.api.fleet_urls``."""

from django.urls import re_path

from . import views

urlpatterns = [
    re_path(r"^/?$", views.AdminWorkerListView.as_view(), name="admin-workers"),
    re_path(r"^/(?P<worker_id>[\w-]+)/?$", views.AdminWorkerDetailView.as_view(), name="admin-worker"),
    re_path(r"^/(?P<worker_id>[\w-]+)/drain/?$", views.AdminWorkerDrainView.as_view(), name="admin-worker-drain"),
]
