"""The worker protocol's endpoints, at the paths ``worker_agent.protocol`` names (mounted at the site's root)."""

from django.urls import re_path

from common.routes import protocol_route
from worker_agent import protocol

from . import agent_views as views
from . import upload_views

urlpatterns = [
    protocol_route(protocol.REGISTER_PATH, views.RegisterView.as_view(), name="worker-register"),
    protocol_route(protocol.HEARTBEAT_PATH, views.HeartbeatView.as_view(), name="worker-heartbeat"),
    protocol_route(protocol.JOB_STATUS_PATH, views.JobStatusView.as_view(), name="worker-job-status"),
    protocol_route(protocol.QUEUE_PATH, views.QueueView.as_view(), name="worker-queue"),
    protocol_route(protocol.DISCONNECT_PATH, views.DisconnectView.as_view(), name="worker-disconnect"),
    re_path(
        rf"^{protocol.UPLOAD_PATH.lstrip('/')}/(?P<bucket>[^/]+)/(?P<key>.+)$",
        upload_views.ArtifactObjectView.as_view(),
        name="artifact-object",
    ),
    protocol_route(protocol.CHECKPOINT_COMPLETE_PATH, upload_views.CheckpointCompleteView.as_view(), name="checkpoint-complete"),
]
