"""The operators' change feed: one unstored SSE channel saying which workers and jobs just changed.

Every state change is audited, so the audit writer is the one place that announces changes. The
feed carries hints, not state: an admin page that hears its objects named re-reads them, and re-reads
everything on (re)connect, so an event lost to a full queue or a Redis outage costs nothing.
"""

import threading

from django.db import transaction

from workers.events import send

CHANGES_CHANNEL = "operator-changes"
CHANGES = "changes"
# Targets named in one event; a larger batch (a sweep) says "many" and pages re-read all they show.
MAX_TARGETS = 100
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


_pending = threading.local()


def _flush():
    targets, _pending.targets = getattr(_pending, "targets", set()), set()
    if targets:
        send(CHANGES_CHANNEL, CHANGES, changes_payload(targets))


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
