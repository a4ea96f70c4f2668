"""Mounted at /api/admin/webhooks (no trailing slash; one is accepted too)."""

from django.urls import re_path

from . import views

urlpatterns = [
    re_path(r"^/?$", views.WebhookListView.as_view(), name="admin-webhooks"),
    re_path(r"^/(?P<webhook_id>[\w-]+)/?$", views.WebhookDetailView.as_view(), name="admin-webhook"),
    re_path(r"^/(?P<webhook_id>[\w-]+)/deliveries/?$", views.DeliveryListView.as_view(), name="admin-webhook-deliveries"),
    re_path(
        r"^/(?P<webhook_id>[\w-]+)/deliveries/(?P<delivery_id>[\w-]+)/redeliver/?$",
        views.DeliveryRedeliverView.as_view(),
        name="admin-webhook-redeliver",
    ),
]
