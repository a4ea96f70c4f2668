"""What the audit log announces: the workers and jobs each committed transaction changed (``CHANGES``).

Every state change is audited, so the audit writer is the one place that announces changes; what moves without
an audit row (a job's progress and log, ``job_queue.reports.announce_progress``) is announced through the same
``announce_changes_on_commit``. A transaction's announcements leave as one ``CHANGES`` emission through
``common.outbox``; the operators' change feed (``realtime.operator_feed``) subscribes to it.
"""

import threading

from django.db import transaction

from common import outbox

CHANGES = "audit.changes"  # payload: targets, a set of (target_type, target_id)
LIVE_TARGET_TYPES = frozenset({"worker", "job"})

_pending = threading.local()


def _flush():
    targets, _pending.targets = getattr(_pending, "targets", set()), set()
    if targets:
        outbox.emit(CHANGES, targets=targets)


def announce_changes_on_commit(targets):
    """Announce, once the transaction commits, that these workers and jobs changed.

    The first of a transaction's commit callbacks sends every target it announced and the rest find
    nothing left. Targets of a rolled-back transaction go out with the next announcement, which costs
    a page one needless re-read and nothing else.
    """
    targets = {(kind, pk) for kind, pk in targets if kind in LIVE_TARGET_TYPES and pk}
    if targets:
        if not hasattr(_pending, "targets"):
            _pending.targets = set()
        _pending.targets |= targets
        transaction.on_commit(_flush, robust=True)
