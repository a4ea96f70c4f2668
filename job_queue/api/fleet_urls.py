"""Mounted at /api/admin/workers beside ``workers.api.admin_urls``: worker actions that reach the worker's job."""

from django.urls import re_path

from . import fleet_views

urlpatterns = [
    re_path(r"^/(?P<worker_id>[\w-]+)/token/?$", fleet_views.AdminWorkerTokenView.as_view(), name="admin-worker-token"),
    re_path(r"^/(?P<worker_id>[\w-]+)/undrain/?$", fleet_views.AdminWorkerUndrainView.as_view(), name="admin-worker-undrain"),
    re_path(r"^/(?P<worker_id>[\w-]+)/labels/?$", fleet_views.AdminWorkerLabelsView.as_view(), name="admin-worker-labels"),
]
