"""The sweep of stored worker events: those older than the replay window leave the library's table."""

import datetime

from django.db import transaction
from django.utils import timezone
from django_eventstream import storage as library_storage
from django_eventstream.models import Event as StoredEvent

TRIM_BATCH = 5000  # rows per DELETE, so a trim never holds SQLite's write lock for long


def trim_stored_events():
    """Delete stored events older than the library's replay window (24 h), in batches; return ``{"events": how many}``.

    A stream resuming from an id trimmed away gets ``stream-reset`` and starts from the current id, as with
    the library's own trim.
    """
    cutoff = timezone.now() - datetime.timedelta(minutes=library_storage.EVENT_TIMEOUT)
    deleted = 0
    while True:
        with transaction.atomic():
            ids = list(StoredEvent.objects.filter(created__lt=cutoff).order_by().values_list("pk", flat=True)[:TRIM_BATCH])
            if ids:
                StoredEvent.objects.filter(pk__in=ids).delete()
        deleted += len(ids)
        if len(ids) < TRIM_BATCH:
            return {"events": deleted}
