from django.urls import re_path

from . import views
from .stream import worker_stream

urlpatterns = [
    re_path(r"^register/?$", views.RegisterView.as_view(), name="worker-register"),
    re_path(r"^stream/?$", worker_stream, name="worker-stream"),
    re_path(r"^heartbeat/?$", views.HeartbeatView.as_view(), name="worker-heartbeat"),
    re_path(r"^job/(?P<job_id>[\w-]+)/status/?$", views.JobStatusView.as_view(), name="worker-job-status"),
    re_path(r"^queue/?$", views.QueueView.as_view(), name="worker-queue"),
    re_path(r"^disconnect/?$", views.DisconnectView.as_view(), name="worker-disconnect"),
]
