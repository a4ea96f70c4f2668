from django.urls import re_path

from . import views

urlpatterns = [re_path(r"^$", views.AuditEventListView.as_view(), name="audit-list")]
