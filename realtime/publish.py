"""Delivery to worker streams: the outbox's worker topics become django-eventstream events.

Every publish leaves only after the transaction that announced it commits (``common.outbox``).
"""

import logging

from django_eventstream import send_event
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

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


def one_line(exc):
    return " ".join(str(exc).split()) or type(exc).__name__


def send(channel, event_type, data):
    """``send_event``; a Redis failure is logged, not raised: the event is stored and every stream catches up.

    The library stores the event before it publishes it, and each server's Redis event listener makes
    its streams re-read storage (and re-check their tokens) when it resubscribes after an outage.
    """
    try:
        send_event(channel, event_type, data)
    except RedisError as exc:
        logger.warning(
            "%s on %s not pushed, Redis is unreachable (%s): streams catch up when Redis is back",
            event_type,
            channel,
            one_line(exc),
        )


def on_worker_event(*, worker_id, event):
    """Subscriber of ``workers.events.WORKER_EVENT``: put ``event`` (with its ``type``) on the worker's stream."""
    send(worker_channel(worker_id), event["type"], event)


def on_streams_revoked(*, worker_id, token_ids, reason, code):
    """Subscriber of ``workers.events.STREAMS_REVOKED``: close the worker's streams opened with ``token_ids``.

    Every process holding one ends it with a ``shutdown`` event carrying ``reason`` and ``code``.
    """
    data = {"tokens": [stream_principal_id(t) for t in token_ids], "reason": reason, "code": code}
    send(CONTROL_PREFIX + worker_channel(worker_id), REVOKE, data)
