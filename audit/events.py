"""The operators' change feed: one unstored SSE channel saying which workers and jobs just changed.

Every state change is audited, so the audit writer is the one place that announces changes. The
feed carries hints, not state: an admin page that hears its objects named re-reads them, and re-reads
everything on (re)connect, so an event lost to a full queue or a Redis outage costs nothing.
"""

import logging
import queue
import threading

from django.db import transaction
from django_eventstream import eventstream as es_eventstream
from django_eventstream import send_event
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

CHANGES_CHANNEL = "operator-changes"
CHANGES = "changes"
# Targets named in one event; a larger batch (a sweep) says "many" and pages re-read all they show.
MAX_TARGETS = 100
# Events waiting for the background publisher (Redis deployments); beyond this they are dropped.
PUBLISH_QUEUE_MAX = 1000
LIVE_TARGET_TYPES = frozenset({"worker", "job"})


class OperatorPrincipal:
    """Stands in for ``request.user`` on the change feed: a signed-in operator allowed to follow it."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, user_id):
        self.pk = f"user:{user_id}"


def changes_payload(targets):
    """Return the ``changes`` event data for ``(target_type, target_id)`` pairs (deduplicated, capped)."""
    unique = sorted(set(targets))
    if len(unique) > MAX_TARGETS:
        return {"type": CHANGES, "many": True, "targets": []}
    return {"type": CHANGES, "many": False, "targets": [{"type": kind, "id": pk} for kind, pk in unique]}


def _send_now(data):
    try:
        send_event(CHANGES_CHANNEL, CHANGES, data)
    except RedisError as exc:
        logger.warning("operator change feed event dropped, Redis is unreachable (%s): admin pages re-read within 10 s", exc)


class _BackgroundPublisher:
    """Publishes feed events from one daemon thread, merging what queued up, dropping beyond a bound.

    With Redis, a publish is network I/O; the transaction that announced a change must not wait on it
    (a hung Redis would add its socket timeout to every audited request).
    """

    def __init__(self):
        self.queue = queue.Queue(maxsize=PUBLISH_QUEUE_MAX)
        self.lock = threading.Lock()
        self.thread = None

    def submit(self, data):
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="operator-feed-publisher", daemon=True)
                self.thread.start()
        try:
            self.queue.put_nowait(data)
        except queue.Full:
            logger.debug("operator change feed event dropped: %d waiting to be published", PUBLISH_QUEUE_MAX)

    def _run(self):
        while True:
            batch = [self.queue.get()]
            while True:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            if any(data["many"] for data in batch):
                _send_now({"type": CHANGES, "many": True, "targets": []})
            else:
                _send_now(changes_payload((t["type"], t["id"]) for data in batch for t in data["targets"]))


_publisher = _BackgroundPublisher()
_pending = threading.local()


def publish(data):
    """Send a ``changes`` event: at once when events stay in this process (no Redis), else in the background."""
    if es_eventstream.redis_client is None:
        _send_now(data)
    else:
        _publisher.submit(data)


def _flush():
    targets, _pending.targets = getattr(_pending, "targets", set()), set()
    if targets:
        publish(changes_payload(targets))


def publish_changes_on_commit(targets):
    """Announce on the change feed, once the transaction commits, that these workers and jobs changed.

    A transaction's announcements leave as one event: the first of its commit callbacks sends them all
    and the rest find nothing left. Targets of a rolled-back transaction go out with the next event,
    which costs a page one needless re-read and nothing else.
    """
    targets = {(kind, pk) for kind, pk in targets if kind in LIVE_TARGET_TYPES and pk}
    if targets:
        if not hasattr(_pending, "targets"):
            _pending.targets = set()
        _pending.targets |= targets
        transaction.on_commit(_flush, robust=True)
