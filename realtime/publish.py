"""Delivery to worker streams: the outbox's worker topics become django-eventstream events.

A worker event is stored in the transaction that announced it (``realtime.storage``; one commit for a
dispatch and its ``job_submit``) and published only after that transaction commits (``common.outbox``).
"""

import json
import logging

from django.core.serializers.json import DjangoJSONEncoder
from django_eventstream import eventstream as es_eventstream
from django_eventstream import send_event
from django_eventstream import views as es_views
from django_eventstream.utils import get_storage
from redis.exceptions import RedisError

from .storage import published_as

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


def send(channel, event_type, data, *, json_encode=True):
    """``send_event``; a Redis failure is logged, not raised: the event is stored and every stream catches up.

    The library stores the event before it publishes it, and each server's Redis event listener makes
    its streams re-read storage (and re-check their tokens) when it resubscribes after an outage.
    """
    try:
        send_event(channel, event_type, data, json_encode=json_encode)
    except RedisError as exc:
        logger.warning(
            "%s on %s not pushed, Redis is unreachable (%s): streams catch up when Redis is back",
            event_type,
            channel,
            one_line(exc),
        )


def stage_worker_event(*, worker_id, event):
    """Stage of ``workers.events.WORKER_EVENT``: store ``event`` (with its ``type``) on the worker's channel, in
    the current transaction (the one that emitted it, when it stages; ``common.outbox``); return it stored."""
    return get_storage().append_event(worker_channel(worker_id), event["type"], json.dumps(event, cls=DjangoJSONEncoder))


def worker_event_order(*, worker_id, event):
    """The order in which one transaction's worker events lock their channels' counters: by channel."""
    return worker_channel(worker_id)


def publish_worker_event(stored):
    """Publish of ``workers.events.WORKER_EVENT``: push the stored event to the streams of its channel.

    With Redis, this process's own streams on the channel get it first, straight from here
    (``WorkerListenerManager.deliver_first``), and the others through Redis as before: a worker whose
    stream this process holds does not wait for the round trip through Redis and the subscriber.
    """
    if es_eventstream.redis_client is not None:
        try:
            es_views.get_listener_manager().deliver_first(stored.channel, stored)
        except Exception:  # noqa: BLE001 - the publish below still brings it (the echo was not recorded)
            logger.exception(
                "%s on %s not queued to this process's streams first; it goes through Redis", stored.type, stored.channel
            )
    with published_as(stored):
        send(stored.channel, stored.type, stored.data, json_encode=False)


def on_streams_revoked(*, worker_id, token_ids, reason, code):
    """Subscriber of ``workers.events.STREAMS_REVOKED``: close the worker's streams opened with ``token_ids``.

    Every process holding one ends it with a ``shutdown`` event carrying ``reason`` and ``code``.
    """
    data = {"tokens": [stream_principal_id(t) for t in token_ids], "reason": reason, "code": code}
    send(CONTROL_PREFIX + worker_channel(worker_id), REVOKE, data)
