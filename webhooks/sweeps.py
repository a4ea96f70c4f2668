"""The webhooks' scheduled work (Celery beat, or the embedded scheduler): send what is due, forget old deliveries."""

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from . import sender
from .models import Delivery, DeliveryAttempt, DeliveryStatus

RETENTION = timedelta(days=30)  # an ended delivery (and its attempts) is kept this long after it ended
TRIM_INTERVAL = 3600  # seconds between trims
TRIM_BATCH = 5000  # deliveries per DELETE, so a trim never holds SQLite's write lock for long


def deliver_due():
    """The scheduled pass over the deliveries due now (retries, and those whose commit's own kick was lost).

    With a broker (``manage.py run_sweeps``) it sends them here and returns what became of them. Without one
    (the embedded scheduler, whose one thread runs every sweep) it wakes this process's sender thread instead,
    so a receiver that hangs never holds the other sweeps up."""
    if not settings.REDIS_URL:
        sender.SENDER.wake()
        return None
    return sender.deliver_due()


def trim_deliveries(*, now=None):
    """Delete the deliveries that ended (delivered or failed) more than ``RETENTION`` ago, with their attempts, in
    batches; return ``{"deliveries": how many}``. Pending ones are never trimmed."""
    cutoff = (now or timezone.now()) - RETENTION
    ended = Delivery.objects.filter(status__in=[DeliveryStatus.DELIVERED, DeliveryStatus.FAILED], finished_at__lt=cutoff)
    deleted = 0
    while True:
        with transaction.atomic():
            seqs = list(ended.order_by().values_list("seq", flat=True)[:TRIM_BATCH])
            if seqs:
                DeliveryAttempt.objects.filter(delivery_id__in=seqs).delete()
                Delivery.objects.filter(seq__in=seqs).delete()
        deleted += len(seqs)
        if len(seqs) < TRIM_BATCH:
            return {"deliveries": deleted}
