"""The dispatch-acknowledgement sweep: a dispatch lost in transit goes back to the queue, retry unspent."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from audit import actions
from audit.tests.support import audit_insert_statements
from job_queue import tasks
from job_queue.models import AttemptOutcome, Job, JobAttempt, JobStatus
from job_queue.sweeps import sweep_unacknowledged_dispatches
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import Worker, WorkerStatus
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows, sent_events

pytestmark = pytest.mark.django_db

LONG_AGO = timedelta(seconds=600)


def _reload(obj):
    obj.refresh_from_db()
    return obj


def lost_dispatch(worker, age=LONG_AGO, **job_fields):
    """Return a job dispatched to ``worker`` ``age`` ago and never acknowledged."""
    job = job_on_worker(worker, status=JobStatus.DISPATCHED, **job_fields)
    dispatched_at = timezone.now() - age
    Job.objects.filter(pk=job.pk).update(dispatched_at=dispatched_at)
    JobAttempt.objects.filter(lease_id=job.lease_id).update(dispatched_at=dispatched_at)
    return _reload(job)


def test_recent_dispatches_and_acknowledged_jobs_are_left_alone():
    fresh = job_on_worker(WorkerFactory(), status=JobStatus.DISPATCHED)
    just_inside = lost_dispatch(WorkerFactory(), age=timedelta(seconds=55))
    running = job_on_worker(WorkerFactory(), status=JobStatus.RUNNING)
    Job.objects.filter(pk=running.pk).update(dispatched_at=timezone.now() - LONG_AGO)
    queued = JobFactory()

    assert sweep_unacknowledged_dispatches() == {"jobs": 0, "workers_freed": 0}

    assert _reload(fresh).status == JobStatus.DISPATCHED
    assert _reload(just_inside).status == JobStatus.DISPATCHED
    assert _reload(running).status == JobStatus.RUNNING
    assert _reload(queued).status == JobStatus.QUEUED
    assert audit_rows() == []


def test_the_timeout_is_the_setting(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "DISPATCH_ACK_TIMEOUT": 30}
    job = lost_dispatch(WorkerFactory(), age=timedelta(seconds=45))

    assert sweep_unacknowledged_dispatches()["jobs"] == 1
    assert _reload(job).last_error == "dispatch not acknowledged within 30 s"


def test_lost_dispatch_is_requeued_without_spending_a_retry_and_its_worker_is_freed():
    worker = WorkerFactory()
    job = lost_dispatch(worker, retry_count=1, attempt_count=2)
    lease = job.lease_id

    assert sweep_unacknowledged_dispatches() == {"jobs": 1, "workers_freed": 1}

    job = _reload(job)
    assert (job.status, job.retry_count, job.attempt_count) == (JobStatus.QUEUED, 1, 2)
    assert (job.worker_id, job.lease_id, job.dispatched_at, job.started_at) == (None, None, None, None)
    assert job.worker_name == worker.name  # history keeps who had it
    assert job.last_error == "dispatch not acknowledged within 60 s"
    attempt = JobAttempt.objects.get(lease_id=lease)
    assert (attempt.outcome, attempt.error) == (AttemptOutcome.UNACKNOWLEDGED, "dispatch not acknowledged within 60 s")
    assert attempt.finished_at is not None
    worker = _reload(worker)
    assert (worker.status, worker.current_job_id) == (WorkerStatus.IDLE, None)
    assert worker.last_job_finished_at is not None

    (changed,) = audit_rows(actions.JOB_STATUS_CHANGED, target_id=job.pk)
    assert (changed.actor_type, changed.actor_name) == ("system", "dispatch-ack-sweep")
    assert changed.details == {
        "from": "dispatched",
        "to": "queued",
        "reason": "dispatch not acknowledged within 60 s",
        "attempt": 2,
        "worker": worker.pk,
    }
    (requeued,) = audit_rows(actions.JOB_REQUEUED, target_id=job.pk)
    assert requeued.details == {
        "reason": "dispatch not acknowledged within 60 s",
        "retry_spent": False,
        "retry_count": 1,
        "max_retries": 3,
        "previous_worker": worker.pk,
    }
    (freed,) = audit_rows(actions.WORKER_STATUS_CHANGED, target_id=worker.pk)
    assert (freed.details["from"], freed.details["to"]) == ("busy", "idle")
    assert job.pk in freed.details["reason"]


def test_a_draining_worker_stays_draining_and_an_offline_one_only_loses_the_job():
    draining = WorkerFactory(draining=True)
    offline = WorkerFactory(offline=True)
    on_draining, on_offline = lost_dispatch(draining), lost_dispatch(offline)
    Worker.objects.filter(pk=offline.pk).update(status=WorkerStatus.OFFLINE)  # job_on_worker made it busy

    assert sweep_unacknowledged_dispatches() == {"jobs": 2, "workers_freed": 2}

    assert (_reload(draining).status, draining.current_job_id) == (WorkerStatus.DRAINING, None)
    assert (_reload(offline).status, offline.current_job_id) == (WorkerStatus.OFFLINE, None)
    assert {_reload(on_draining).status, _reload(on_offline).status} == {JobStatus.QUEUED}
    assert audit_rows(actions.WORKER_STATUS_CHANGED) == []  # neither changed status
    assert len(audit_rows(actions.JOB_REQUEUED)) == 2


def test_a_worker_that_holds_another_job_is_not_touched():
    worker = WorkerFactory()
    job = lost_dispatch(worker)
    other = JobFactory(status=JobStatus.RUNNING)
    Worker.objects.filter(pk=worker.pk).update(current_job=other)  # inconsistent, but not ours to fix

    assert sweep_unacknowledged_dispatches() == {"jobs": 1, "workers_freed": 0}

    assert _reload(job).status == JobStatus.QUEUED
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.BUSY, other.pk)


def test_requeued_job_is_dispatched_again_on_commit_to_another_worker(commit):
    lost_on = WorkerFactory()
    job = lost_dispatch(lost_on)
    spare = WorkerFactory()

    with commit():
        sweep_unacknowledged_dispatches()

    job = _reload(job)
    assert (job.status, job.worker_id, job.attempt_count, job.retry_count) == (JobStatus.DISPATCHED, spare.pk, 2, 0)
    assert [(e["type"], e["data"]["attempt_number"]) for e in sent_events(spare.pk)] == [("job_submit", 2)]
    # The freed worker ran least recently, so it goes to the back of the line.
    assert (_reload(lost_on).status, lost_on.current_job_id) == (WorkerStatus.IDLE, None)


def status_url(job_id):
    return f"/api/workers/job/{job_id}/status"


def test_a_late_acknowledgement_of_the_old_attempt_is_refused_when_the_job_came_back_to_the_same_worker(
    worker_client, commit
):
    worker = WorkerFactory()
    job = lost_dispatch(worker)
    old_attempt = job.lease_id
    with commit():
        sweep_unacknowledged_dispatches()
    job = _reload(job)
    assert (job.status, job.worker_id) == (JobStatus.DISPATCHED, worker.pk)  # the only worker: same one again
    assert job.lease_id != old_attempt

    # The lost job_submit finally arrives and the agent acknowledges the attempt it names.
    response = worker_client(worker).post(status_url(job.pk), {"status": "starting", "attempt": old_attempt})

    assert response.status_code == 409
    assert (response.json()["code"], response.json()["abandon_job"]) == ("stale_attempt", job.pk)
    assert _reload(job).status == JobStatus.DISPATCHED  # the new attempt is still waiting for its own ack
    (refused,) = audit_rows(actions.JOB_REPORT_REFUSED, target_id=job.pk)
    assert (refused.details["reason"], refused.details["attempt"]) == ("stale_attempt", old_attempt)
    # The new attempt is acknowledged as usual.
    response = worker_client(worker).post(status_url(job.pk), {"status": "starting", "attempt": job.lease_id})
    assert response.status_code == 200
    assert _reload(job).status == JobStatus.RUNNING


def test_a_late_acknowledgement_is_refused_while_the_job_waits_in_the_queue(worker_client):
    worker = WorkerFactory()
    job = lost_dispatch(worker)
    old_attempt = job.lease_id
    sweep_unacknowledged_dispatches()  # not committed: nothing dispatches it again

    response = worker_client(worker).post(status_url(job.pk), {"status": "starting", "attempt": old_attempt})

    assert response.status_code == 409
    assert response.json()["code"] == "job_not_owned"
    job = _reload(job)
    assert (job.status, job.worker_id) == (JobStatus.QUEUED, None)
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.IDLE, None)


def _lost_dispatches(count):
    return [lost_dispatch(WorkerFactory()) for _ in range(count)]


def test_sweep_cost_does_not_grow_with_the_number_of_jobs():
    _lost_dispatches(3)
    with CaptureQueriesContext(connection) as few:
        assert sweep_unacknowledged_dispatches()["jobs"] == 3
    _lost_dispatches(30)
    with CaptureQueriesContext(connection) as many:
        assert sweep_unacknowledged_dispatches()["jobs"] == 30
    assert len(many) - _audit_inserts(many) == len(few) - _audit_inserts(few)
    # the 90 audit rows in one INSERT (PostgreSQL), or in Django's batches (SQLite: 83 rows a statement)
    assert _audit_inserts(many) == audit_insert_statements(90)


def _audit_inserts(captured):
    return len([q for q in captured.captured_queries if 'INSERT INTO "audit_auditevent"' in q["sql"]])


def test_sweep_over_30_jobs_is_a_handful_of_queries(django_assert_num_queries):
    _lost_dispatches(30)
    # 7: the savepoint and its release; the jobs (and whether a server could hear them, in the same
    # query), their workers; one UPDATE each of attempts, jobs and workers; then the INSERT of the 90
    # audit rows (one on PostgreSQL, two on SQLite). Before the audit chain was sealed after commit, the
    # chain's head was also locked and moved: 11 at most. And one read of the active webhooks (webhooks.staging:
    # the deliveries of the jobs requeued), whatever their number.
    inserts = audit_insert_statements(90)
    with django_assert_num_queries(8 + inserts) as captured:
        assert sweep_unacknowledged_dispatches() == {"jobs": 30, "workers_freed": 30}
    assert _audit_inserts(captured) == inserts
    assert Job.objects.filter(status=JobStatus.QUEUED).count() == 30
    assert Worker.objects.filter(status=WorkerStatus.IDLE, current_job__isnull=True).count() == 30
    assert len(audit_rows(actions.JOB_REQUEUED)) == 30


def test_the_celery_task_runs_the_sweep():
    job = lost_dispatch(WorkerFactory())

    tasks.sweep_unacknowledged_dispatches()

    assert _reload(job).status == JobStatus.QUEUED
