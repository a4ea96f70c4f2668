"""Where worker events are stored: django-eventstream's own tables, written in the caller's transaction.

The library's ``DjangoModelStorage`` stores an event in a transaction of its own after ours commits (the
counter read, a ``SELECT … FOR UPDATE`` of it, the event, the counter's update, a commit) and then looks for
old events to trim, on every event. ``EventStorage`` keeps the library's tables, ids and reads, and
differs in three ways:

- an append is one ``UPDATE … RETURNING`` of the channel's counter and one INSERT (on PostgreSQL one
  statement holding both), in the caller's transaction if there is one, so a dispatch and the
  ``job_submit`` it publishes commit together (``realtime.publish.stage_worker_event``);
- the counter row stays locked until that commit, so a channel's event ids are given and made visible in
  commit order, as the library's own lock makes them;
- old events are trimmed by a sweep (``realtime.sweeps.trim_stored_events``), not on every append.

The library's ``send_event`` still publishes every event (Redis or the local listeners); for an event
already stored in the transaction, ``published_as`` hands the stored one back instead of storing it twice.
"""

import json
from contextvars import ContextVar

from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection, transaction
from django.utils import timezone
from django_eventstream import storage as library_storage
from django_eventstream.event import Event
from django_eventstream.models import Event as StoredEvent
from django_eventstream.models import EventCounter

from common.scoped import bound

_COUNTERS = EventCounter._meta.db_table
_EVENTS = StoredEvent._meta.db_table
# A channel's counter moved on by one (``updated``, ``name``): its new value, the next event's id.
_COUNT = f"UPDATE {_COUNTERS} SET value = value + 1, updated = %s WHERE name = %s RETURNING value"

_prestored = ContextVar("prestored_event", default=None)


class EventStorage(library_storage.DjangoModelStorage):
    """``DjangoModelStorage`` whose append joins the caller's transaction (see the module's docstring)."""

    def append_event(self, channel, event_type, data):
        prestored = _prestored.get()
        if prestored is not None and prestored.channel == channel and prestored.type == event_type:
            _prestored.set(None)
            return prestored
        stored = json.dumps(data, cls=DjangoJSONEncoder)  # as the library stores it
        with transaction.atomic(savepoint=False):
            eid = _counted_insert(channel, event_type, stored) if connection.vendor == "postgresql" else None
            if eid is None:
                eid = _next_event_id(channel)
                StoredEvent(channel=channel, type=event_type, data=stored, eid=eid).save()
        return Event(channel, event_type, data, id=eid)

    def get_events(self, channel, last_id, limit=100):
        """The library's read, its DB connection given back at once outside a transaction.

        The library's stream reads in the request's own thread (``sync_to_async``, thread-sensitive). When
        Django's handler serves the stream (``SIMPLETUNER_FAST_PATHS=off``) that thread lasts as long as the
        stream, so a connection left open there was held per stream: 20 streams took PostgreSQL's whole pool
        and every other request then failed after the pool's 30 s.
        """
        try:
            return super().get_events(channel, last_id, limit=limit)
        finally:
            if not connection.in_atomic_block:
                connection.close()


def _counted_insert(channel, event_type, stored):
    """PostgreSQL: move ``channel``'s counter on and store the event under the new id in one statement (a
    data-modifying WITH); return the id, or None if the channel has no counter yet (then ``_next_event_id``)."""
    now = timezone.now()
    with connection.cursor() as cursor:
        cursor.execute(
            f"WITH counted AS ({_COUNT}) "
            f'INSERT INTO "{_EVENTS}" ("channel", "type", "data", "eid", "created") '
            "SELECT %s, %s, %s, value, %s FROM counted RETURNING eid",
            [now, channel, channel, event_type, stored, now],
        )
        row = cursor.fetchone()
    return None if row is None else row[0]


def _next_event_id(channel):
    """Move ``channel``'s counter on by one and return the new id; the row stays locked until commit.

    A channel's first event makes its counter and the library's id-0 placeholder (so a stream that starts
    at 0 can be read from), exactly once however many transactions race for it.
    """
    now = timezone.now()
    with connection.cursor() as cursor:
        for _ in range(2):
            cursor.execute(_COUNT, [now, channel])
            row = cursor.fetchone()
            if row is not None:
                return row[0]
            cursor.execute(
                f"INSERT INTO {_COUNTERS} (name, value, updated) VALUES (%s, 0, %s) ON CONFLICT (name) DO NOTHING RETURNING id",
                [channel, now],
            )
            if cursor.fetchone() is not None:
                StoredEvent.objects.bulk_create([StoredEvent(channel=channel, eid=0)])  # not save(): it would count
    raise RuntimeError(f"event counter of {channel} could not be made")  # another transaction deleted it meanwhile


def published_as(event):
    """While open, the storage's next append of ``event``'s channel and type returns ``event`` (stored already)."""
    return bound(_prestored, event)
