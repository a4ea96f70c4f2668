"""SSE channels and event types for workers; every publish leaves only after the transaction commits."""

import json
import logging

from django.db import transaction
from django_eventstream import send_event
from django_eventstream import views as es_views
from django_eventstream.channelmanager import ChannelManagerBase

logger = logging.getLogger(__name__)

# Event types, carried both as the SSE `event:` field and as `type` in the JSON data.
JOB_SUBMIT = "job_submit"
JOB_CANCEL = "job_cancel"
DRAIN = "drain"
SHUTDOWN = "shutdown"

# Control messages travel on unstored channels (through Redis when configured, so every process
# sees them) and are consumed by the listener manager; they never reach a client as an event.
CONTROL_PREFIX = "_control:"
REVOKE = "revoke"


def worker_channel(worker_id):
    """Return the SSE channel that carries ``worker_id``'s dispatch feed."""
    return f"worker-{worker_id}"


def stream_principal_id(token_id):
    """Return the listener identity of a stream opened with token ``token_id`` (used to close it)."""
    return f"token:{token_id}"


def publish_on_commit(worker_id, event_type, **payload):
    """Send ``event_type`` with ``payload`` to ``worker_id``'s stream once the current transaction commits."""
    data = {"type": event_type, **payload}
    channel = worker_channel(worker_id)

    def _send():
        send_event(channel, event_type, data)

    transaction.on_commit(_send, robust=True)


def revoke_streams_on_commit(worker_id, token_ids, reason):
    """Close every open stream of ``worker_id`` that was opened with one of ``token_ids``, on commit."""
    data = {"tokens": [stream_principal_id(t) for t in token_ids], "reason": reason}
    channel = CONTROL_PREFIX + worker_channel(worker_id)
    transaction.on_commit(lambda: send_event(channel, REVOKE, data), robust=True)


class StreamPrincipal:
    """Stands in for ``request.user`` on a worker stream: which token opened it and what it may read."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, token_id, worker_id):
        self.pk = stream_principal_id(token_id)
        self.worker_id = worker_id
        self.channels = frozenset({worker_channel(worker_id)})
        self.revoked = False
        self.revoked_reason = ""


class WorkerChannelManager(ChannelManagerBase):
    """Streams read exactly the channels our view passes; ``?channel=`` from a client is never honoured."""

    def get_channels_for_request(self, request, view_kwargs):
        return set(view_kwargs.get("channels", ()))

    def can_read_channel(self, user, channel):
        return isinstance(user, StreamPrincipal) and not user.revoked and channel in user.channels

    def is_channel_reliable(self, channel):
        return not channel.startswith(CONTROL_PREFIX)


class WorkerListenerManager(es_views.ListenerManager):
    """The library's listener registry, plus control messages that end streams across processes."""

    def add_to_queues(self, channel, event):
        if channel.startswith(CONTROL_PREFIX):
            if event.type == REVOKE:
                data = json.loads(event.data) if isinstance(event.data, str) else event.data
                self.revoke(channel[len(CONTROL_PREFIX):], set(data.get("tokens", ())), data.get("reason", ""))
            return
        super().add_to_queues(channel, event)

    def revoke(self, channel, principals, reason):
        """End the local streams on ``channel`` held by any of ``principals``.

        The principal is marked revoked and the stream woken as if its queue overflowed: the library
        then re-reads the channel, finds it no longer readable, sends ``stream-error`` and ends.
        """
        with self.lock:
            doomed = [
                listener
                for listener in self.listeners_by_channel.get(channel, ())
                if listener.user_id in principals
            ]
            for listener in doomed:
                listener.principal.revoked = True
                listener.principal.revoked_reason = reason or "access revoked"
                listener.overflow = True
        for listener in doomed:
            listener.wake_threadsafe()
        if doomed:
            logger.info("closed %d stream(s) on %s: %s", len(doomed), channel, reason)


def install_listener_manager():
    """Replace the library's module-level listener manager with ours (idempotent)."""
    if not isinstance(es_views.listener_manager, WorkerListenerManager):
        es_views.listener_manager = WorkerListenerManager()
