"""Reads of webhooks and their deliveries: who subscribes to an event, the deliveries due, a webhook's deliveries."""

import threading

from django.db import connection, transaction
from django.db.models import Exists, OuterRef

from common.prepared import PreparedQuery

from .models import Delivery, DeliveryStatus, Webhook


# Read in every transaction that ends a job: compiled once (building and compiling the queryset cost about
# 0.3 ms of a completion's CPU, bench/dispatch_cost.py).
_ACTIVE_WEBHOOKS = PreparedQuery(lambda: Webhook.objects.filter(active=True))
_read = threading.local()  # the active webhooks as the current transaction read them, and its marker


class _Marker:
    """A no-op commit callback: while the transaction that read the webhooks is open, it is among its callbacks."""

    def __call__(self):
        pass


def webhooks_active():
    """Return the active webhooks: one read of a small table per transaction (or savepoint): the several changes
    of one sweep share it. A webhook written meanwhile (``forget_webhooks_read``) is read again."""
    marker = getattr(_read, "marker", None)
    if (
        marker is not None
        and connection.in_atomic_block
        and _read.savepoints == connection.savepoint_ids
        and any(func is marker for _s, func, _r in connection.run_on_commit)
    ):
        return _read.hooks
    hooks = _ACTIVE_WEBHOOKS.run()
    if connection.in_atomic_block:
        _read.marker, _read.hooks, _read.savepoints = _Marker(), hooks, list(connection.savepoint_ids)
        transaction.on_commit(_read.marker)
    return hooks


def forget_webhooks_read():
    """Have the next ``webhooks_active`` read the table again (a webhook was written)."""
    _read.marker = None


def webhooks_subscribed(events):
    """Return the active webhooks subscribed to any of ``events``."""
    return [hook for hook in webhooks_active() if set(hook.events) & set(events)]


def deliveries_due(*, now):
    """Return the pending deliveries due at ``now`` with no earlier delivery of their subject to their webhook still
    pending (one job's events arrive in order), the longest waiting first.

    Indexed: ``webhook_delivery_due`` finds the due ones, ``webhook_delivery_order`` answers each one's look back.
    """
    earlier = Delivery.objects.filter(
        status=DeliveryStatus.PENDING, webhook_id=OuterRef("webhook_id"), subject=OuterRef("subject"), seq__lt=OuterRef("seq")
    )
    return (
        Delivery.objects.filter(status=DeliveryStatus.PENDING, next_attempt_at__lte=now)
        .filter(~Exists(earlier))
        .order_by("next_attempt_at", "seq")
    )


def webhook_deliveries(webhook_id):
    """Return ``webhook_id``'s deliveries, newest first."""
    return Delivery.objects.filter(webhook_id=webhook_id).order_by("-seq")
