"""workers_transition enforces WORKER_TRANSITIONS over every (from, to) pair, and audits each change."""

import itertools

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from audit import actions
from audit.services import Actor
from common.errors import InvalidTransition
from workers.models import WORKER_TRANSITIONS, Worker, WorkerStatus
from workers.transitions import workers_transition
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

ACTOR = Actor.system("test")
PAIRS = list(itertools.product(WorkerStatus.values, repeat=2))
ALLOWED = [(before, after) for before, after in PAIRS if before in WORKER_TRANSITIONS[after]]
FORBIDDEN = [(before, after) for before, after in PAIRS if before not in WORKER_TRANSITIONS[after]]


def test_every_pair_is_either_allowed_or_forbidden():
    assert len(ALLOWED) + len(FORBIDDEN) == len(WorkerStatus.values) ** 2
    assert FORBIDDEN, "a table that allows everything guards nothing"


@pytest.mark.parametrize(("before", "after"), FORBIDDEN)
def test_forbidden_transition_raises_and_changes_nothing(before, after):
    worker = WorkerFactory(status=before, gpu_name="original")
    changed_at = Worker.objects.get(pk=worker.pk).status_changed_at

    with pytest.raises(InvalidTransition):
        workers_transition(workers=[worker], to=after, actor=ACTOR, gpu_name="changed")

    stored = Worker.objects.get(pk=worker.pk)
    assert (stored.status, stored.gpu_name, stored.status_changed_at) == (before, "original", changed_at)
    assert audit_rows() == []


@pytest.mark.parametrize(("before", "after"), ALLOWED)
def test_allowed_transition_writes_status_fields_and_one_audit_row_when_status_changes(before, after):
    worker = WorkerFactory(status=before, gpu_name="original")

    (returned,) = workers_transition(workers=[worker], to=after, actor=ACTOR, reason="because", gpu_name="changed")

    stored = Worker.objects.get(pk=worker.pk)
    assert (stored.status, stored.gpu_name) == (after, "changed")
    assert (returned.status, returned.gpu_name) == (after, "changed")
    rows = audit_rows(actions.WORKER_STATUS_CHANGED, target_id=worker.pk)
    if before == after:
        assert rows == []
    else:
        (row,) = rows
        assert row.details == {"from": before, "to": after, "reason": "because"}
        assert (row.actor_type, row.actor_name, row.success) == ("system", "test", True)
    assert len(audit_rows()) == len(rows)


def test_transition_from_a_stale_copy_is_refused():
    """Another process moved the worker since it was read: the guarded update matches no row."""
    worker = WorkerFactory(status=WorkerStatus.IDLE)
    Worker.objects.filter(pk=worker.pk).update(status=WorkerStatus.OFFLINE)

    with pytest.raises(InvalidTransition):
        workers_transition(workers=[worker], to=WorkerStatus.BUSY, actor=ACTOR)

    assert Worker.objects.get(pk=worker.pk).status == WorkerStatus.OFFLINE
    assert audit_rows() == []


def test_no_transition_leads_back_to_connecting():
    assert WORKER_TRANSITIONS[WorkerStatus.CONNECTING] == frozenset()


def test_workers_bound_for_different_statuses_move_in_one_update():
    idle, busy, draining = WorkerFactory(), WorkerFactory(status=WorkerStatus.BUSY), WorkerFactory(status=WorkerStatus.BUSY)
    Worker.objects.filter(pk=draining.pk).update(drain_requested_at=draining.created_at)
    workers = list(Worker.objects.filter(pk__in=[idle.pk, busy.pk, draining.pk]))
    targets = {idle.pk: WorkerStatus.BUSY, busy.pk: WorkerStatus.IDLE, draining.pk: WorkerStatus.DRAINING}

    with CaptureQueriesContext(connection) as captured:
        workers_transition(workers=workers, to=lambda w: targets[w.pk], actor=ACTOR, reason="because", gpu_name="changed")

    assert len([q for q in captured.captured_queries if q["sql"].startswith('UPDATE "workers_worker"')]) == 1
    assert {w.pk: (w.status, w.gpu_name) for w in Worker.objects.all()} == {
        pk: (status, "changed") for pk, status in targets.items()
    }
    moved = {row.target_id: (row.details["from"], row.details["to"]) for row in audit_rows(actions.WORKER_STATUS_CHANGED)}
    assert moved == {idle.pk: ("idle", "busy"), busy.pk: ("busy", "idle"), draining.pk: ("busy", "draining")}
