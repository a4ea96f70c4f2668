"""Mounted at /api/admin (no trailing slash, as the workers' routes; one is accepted too)."""

from django.urls import re_path

from . import views

urlpatterns = [
    re_path(r"^teams/?$", views.TeamListView.as_view(), name="admin-teams"),
    re_path(r"^teams/(?P<team>[^/]+)/?$", views.TeamDetailView.as_view(), name="admin-team"),
    re_path(r"^teams/(?P<team>[^/]+)/limits/?$", views.TeamLimitsView.as_view(), name="admin-team-limits"),
    re_path(r"^users/(?P<username>[^/]+)/limits/?$", views.UserLimitsView.as_view(), name="admin-user-limits"),
    re_path(r"^limits/?$", views.GlobalLimitsView.as_view(), name="admin-limits"),
]
