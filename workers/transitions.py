"""The one writer of ``Worker.status``: every change of it, for a set of workers, audited in the caller's transaction.

Callers lock the rows first (``select_for_update``) and pass model instances (a set of one for a
single worker). The transition table is ``workers.models.WORKER_TRANSITIONS``; an illegal change raises
``InvalidTransition`` and, inside the caller's transaction, rolls everything back. Services, sweeps,
admin actions, API views, management commands and the local worker all come here.
"""

from django.utils import timezone

from audit import actions
from audit.services import audit_events, audit_write
from common import outbox
from common.errors import InvalidTransition
from common.updates import update_rows

from . import events
from .models import WORKER_ONLINE, WORKER_TRANSITIONS, Worker, WorkerStatus


def worker_resting_status(worker, *, busy):
    """Return the status a live worker should have: draining wins, then busy, then idle."""
    if worker.drain_requested_at is not None:
        return WorkerStatus.DRAINING
    return WorkerStatus.BUSY if busy else WorkerStatus.IDLE


def workers_transition(*, workers, to, actor, reason="", now=None, **fields):
    """Move each locked worker in ``workers`` to ``to`` (a status, or a function of the worker), writing ``fields``.

    ``reason`` is a string or a function of the worker. A worker already in its target status only
    gets ``fields`` (no audit row). One UPDATE and one audit write, whatever the number of workers and
    targets. Raise InvalidTransition if the table forbids a change, or if a worker's status changed
    since the caller read it. Return ``workers``, updated in place.
    """
    now = now or timezone.now()
    changes, read, audit_rows = {}, {}, []
    for worker in workers:
        target = to(worker) if callable(to) else to
        if worker.status not in WORKER_TRANSITIONS[target]:
            raise InvalidTransition(f"worker {worker.pk} cannot go from {worker.status} to {target}")
        changes[worker.pk] = dict(fields, status=target)
        if worker.status != target:
            changes[worker.pk]["status_changed_at"] = now
            why = reason(worker) if callable(reason) else reason
            audit_rows.append((worker.pk, {"from": worker.status, "to": target, "reason": why}))
        # Each row only from the status the caller read (the rows are locked: a mismatch is a bug, refused).
        read[worker.pk] = {"status": worker.status}
    updated = update_rows(Worker.objects, changes, expect=read)
    if updated != len(changes):
        raise InvalidTransition(f"{len(changes) - updated} worker(s) changed status concurrently; their moves are refused")
    moved = [(w.pk, w.status, changes[w.pk]["status"]) for w in workers if w.status != changes[w.pk]["status"]]
    for worker in workers:
        for name, value in changes[worker.pk].items():
            setattr(worker, name, value)
    if moved:
        outbox.emit_on_commit(events.STATUS_CHANGED, changes=moved, at=now)
    audit_write(
        audit_events(actor=actor, action=actions.WORKER_STATUS_CHANGED, target_type="worker", rows=audit_rows)
    )
    return workers


def workers_free(*, workers, actor, reason, now=None):
    """Free locked ``workers`` whose job is over: online ones rest (draining or idle), the others only lose it.

    Return the workers now idle (the caller offers them work).
    """
    now = now or timezone.now()
    free = {"current_job": None, "last_job_finished_at": now}
    online = [w for w in workers if w.status in WORKER_ONLINE]
    away = [w for w in workers if w.status not in WORKER_ONLINE]
    if online:
        workers_transition(
            workers=online, to=lambda w: worker_resting_status(w, busy=False), actor=actor, reason=reason, now=now, **free
        )
    if away:  # offline (or never registered): no session to return to
        Worker.objects.filter(pk__in=[w.pk for w in away]).update(**free)
        for worker in away:
            worker.current_job = None
            worker.last_job_finished_at = now
    return [w for w in online if w.status == WorkerStatus.IDLE]
