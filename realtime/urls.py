"""The two streams: a worker's dispatch feed and the operators' change feed (mounted at the site's root)."""

from django.urls import path

from common.routes import protocol_route
from worker_agent import protocol

from .operator_feed import OPERATOR_FEED_PATH, operator_changes_stream
from .streams import worker_stream

urlpatterns = [
    protocol_route(protocol.STREAM_PATH, worker_stream, name="worker-stream"),
    path(OPERATOR_FEED_PATH.lstrip("/"), operator_changes_stream, name="admin-live-changes"),
]

# Paths whose requests run without Django's per-request thread (``serving.asgi``).
STREAM_PATHS = frozenset({protocol.STREAM_PATH, protocol.STREAM_PATH + "/", OPERATOR_FEED_PATH})
