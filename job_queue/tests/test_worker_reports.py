"""POST /api/workers/job/<id>/status: only the current attempt's worker moves the job, and what follows."""

import pytest

from audit import actions
from job_queue.models import AttemptOutcome, JobAttempt, JobStatus
from job_queue.dispatch import dispatch_for_job
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import WorkerStatus, WorkerType
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows, sent_events

pytestmark = pytest.mark.django_db


def status_url(job_id):
    return f"/api/workers/job/{job_id}/status"


def _reload(obj):
    obj.refresh_from_db()
    return obj


@pytest.fixture
def report(worker_client):
    """``report(worker, job, status, **fields)`` posts a status report with the worker's token."""

    def _report(worker, job, status, **fields):
        return worker_client(worker).post(status_url(job.pk), {"status": status, **fields})

    return _report


# --- who may report -------------------------------------------------------------------------------


def test_report_from_a_worker_that_does_not_hold_the_job_is_409_and_audited(report):
    owner = WorkerFactory()
    job = job_on_worker(owner, status=JobStatus.DISPATCHED)
    intruder = WorkerFactory()

    response = report(intruder, job, "completed")

    assert response.status_code == 409
    body = response.json()
    assert (body["code"], body["abandon_job"]) == ("job_not_owned", job.pk)
    assert _reload(job).status == JobStatus.DISPATCHED
    assert (_reload(intruder).status, _reload(owner).status) == (WorkerStatus.IDLE, WorkerStatus.BUSY)
    (refused,) = audit_rows(actions.JOB_REPORT_REFUSED, target_id=job.pk)
    assert refused.success is False
    assert (refused.actor_type, refused.actor_id) == ("worker", intruder.pk)
    assert refused.details == {"reported": "completed", "attempt": None, "reason": "job_not_owned", "refusals_in_previous_window": 0}
    assert audit_rows(actions.JOB_STATUS_CHANGED) == []


def test_report_for_an_old_attempt_is_409_and_audited(report):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING, attempt_count=2)

    response = report(worker, job, "failed", attempt="a_previous_attempt", error="boom")

    assert response.status_code == 409
    assert response.json()["code"] == "stale_attempt"
    job = _reload(job)
    assert (job.status, job.last_error) == (JobStatus.RUNNING, "")
    assert _reload(worker).status == WorkerStatus.BUSY
    (refused,) = audit_rows(actions.JOB_REPORT_REFUSED, target_id=job.pk)
    assert (refused.success, refused.details["reason"], refused.details["attempt"]) == (
        False,
        "stale_attempt",
        "a_previous_attempt",
    )


def test_report_for_a_job_requeued_away_from_the_worker_is_refused(report):
    worker = WorkerFactory()
    job = JobFactory(status=JobStatus.QUEUED, attempt_count=1, retry_count=1)

    response = report(worker, job, "running")

    assert response.status_code == 409
    assert response.json()["code"] == "job_not_owned"
    assert _reload(job).status == JobStatus.QUEUED


def test_report_for_an_unknown_job_is_404(worker_client):
    response = worker_client(WorkerFactory()).post(status_url("j_0000000000000000"), {"status": "running"})

    assert response.status_code == 404
    assert response.json()["code"] == "not_found"


@pytest.mark.parametrize("body", [{"status": "exploded"}, {}, {"status": "completed", "exit_code": "zero"}])
def test_malformed_report_is_400_and_changes_nothing(worker_client, body):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    response = worker_client(worker).post(status_url(job.pk), body)

    assert response.status_code == 400
    assert response.json()["code"] == "invalid"
    assert _reload(job).status == JobStatus.RUNNING
    assert audit_rows() == []


def test_report_without_a_token_is_401(api_client):
    job = job_on_worker(WorkerFactory())

    response = api_client.post(status_url(job.pk), {"status": "completed"})

    assert response.status_code == 401
    assert _reload(job).status == JobStatus.RUNNING


def test_the_agent_reports_the_attempt_it_was_sent(worker_client, commit):
    worker = WorkerFactory()
    job = JobFactory()
    with commit():
        dispatch_for_job(job.pk)
    (event,) = sent_events(worker.pk)

    response = worker_client(worker).post(status_url(job.pk), {"status": "starting", "attempt": event["data"]["attempt"]})

    assert response.status_code == 200
    assert _reload(job).status == JobStatus.RUNNING


# --- running ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("reported", ["starting", "training", "running"])
def test_starting_training_and_running_all_mean_running(report, reported):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.DISPATCHED)

    response = report(worker, job, reported, attempt=job.lease_id, progress=0.1)

    assert response.status_code == 200
    assert response.json() == {"job_id": job.pk, "status": "running", "accepted": True}
    job = _reload(job)
    assert (job.status, job.progress) == (JobStatus.RUNNING, {"fraction": 0.1})
    assert job.started_at is not None
    assert JobAttempt.objects.get(lease_id=job.lease_id).started_at is not None
    (changed,) = audit_rows(actions.JOB_STATUS_CHANGED, target_id=job.pk)
    assert (changed.details["from"], changed.details["to"], changed.details["reason"]) == (
        "dispatched",
        "running",
        reported,
    )


def test_repeated_running_reports_only_update_progress(report):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING)

    for step in (1, 2):
        assert report(worker, job, "training", progress={"step": step}).status_code == 200

    assert (_reload(job).status, job.progress) == (JobStatus.RUNNING, {"step": 2})
    assert audit_rows(actions.JOB_STATUS_CHANGED) == []


# --- terminal reports -------------------------------------------------------------------------------


def test_completed_frees_a_persistent_worker_and_dispatches_the_next_job(report, commit):
    worker = WorkerFactory(worker_type=WorkerType.PERSISTENT)
    job = job_on_worker(worker)
    following = JobFactory()

    with commit():
        response = report(worker, job, "completed", exit_code=0, log_tail="done")

    assert response.json() == {"job_id": job.pk, "status": "completed", "accepted": True}
    job = _reload(job)
    assert (job.status, job.progress["fraction"], job.exit_code, job.log_tail) == (JobStatus.COMPLETED, 1.0, 0, "done")
    assert job.finished_at is not None
    assert JobAttempt.objects.get(lease_id=job.lease_id).outcome == AttemptOutcome.COMPLETED
    worker = _reload(worker)
    assert (worker.status, worker.current_job_id) == (WorkerStatus.BUSY, following.pk)
    assert worker.last_job_finished_at is not None
    assert _reload(following).status == JobStatus.DISPATCHED
    assert [(e["type"], e["data"]["job_id"]) for e in sent_events(worker.pk)] == [("job_submit", following.pk)]


def test_completed_frees_an_ephemeral_worker_without_dispatching_to_it(report, commit):
    worker = WorkerFactory(worker_type=WorkerType.EPHEMERAL)
    job = job_on_worker(worker)
    following = JobFactory()

    with commit():
        report(worker, job, "completed")

    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.IDLE, None)
    assert _reload(following).status == JobStatus.QUEUED
    assert sent_events() == []


def test_completed_on_a_draining_worker_leaves_it_draining_with_nothing_new(report, commit):
    worker = WorkerFactory(draining=True)
    job = job_on_worker(worker)
    following = JobFactory()

    with commit():
        report(worker, job, "completed")

    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.DRAINING, None)
    assert _reload(following).status == JobStatus.QUEUED
    assert sent_events() == []


def test_completed_report_is_idempotent(report):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    first = report(worker, job, "completed")
    second = report(worker, job, "completed")

    assert (first.status_code, second.status_code) == (200, 200)
    assert len(audit_rows(actions.JOB_STATUS_CHANGED, target_id=job.pk)) == 1


def test_a_different_terminal_report_after_completion_is_409(report):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    report(worker, job, "completed")

    response = report(worker, job, "failed", error="late")

    assert response.status_code == 409
    assert response.json()["code"] == "invalid_transition"
    assert _reload(job).status == JobStatus.COMPLETED


def test_failed_without_retry_on_failure_fails_the_job(report, commit):
    worker = WorkerFactory()
    job = job_on_worker(worker, retry_on_failure=False)

    with commit():
        report(worker, job, "failed", error="Training exited with code 1", exit_code=1)

    job = _reload(job)
    assert (job.status, job.last_error, job.exit_code, job.retry_count) == (
        JobStatus.FAILED,
        "Training exited with code 1",
        1,
        0,
    )
    attempt = JobAttempt.objects.get(lease_id=job.lease_id)
    assert (attempt.outcome, attempt.error) == (AttemptOutcome.FAILED, "Training exited with code 1")
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.IDLE, None)


def test_failed_with_retry_on_failure_requeues_while_retries_remain(report, commit):
    worker = WorkerFactory()
    job = job_on_worker(worker, retry_on_failure=True, max_retries=2)

    with commit():
        report(worker, job, "failed", error="CUDA out of memory")

    job = _reload(job)
    # Requeued with one retry spent, then dispatched again (to the now idle worker) as attempt 2.
    assert (job.status, job.retry_count, job.attempt_count, job.worker_id) == (JobStatus.DISPATCHED, 1, 2, worker.pk)
    assert [a.outcome for a in JobAttempt.objects.filter(job=job).order_by("number")] == [
        AttemptOutcome.FAILED,
        AttemptOutcome.PENDING,
    ]
    (requeued,) = audit_rows(actions.JOB_REQUEUED, target_id=job.pk)
    assert requeued.details["reason"] == "attempt 1 failed: CUDA out of memory"
    assert [e["data"]["attempt_number"] for e in sent_events(worker.pk)] == [2]


def test_failed_with_retry_on_failure_and_no_retries_left_fails_for_good(report):
    worker = WorkerFactory()
    job = job_on_worker(worker, retry_on_failure=True, max_retries=1, retry_count=1, attempt_count=2)

    report(worker, job, "failed", error="CUDA out of memory")

    job = _reload(job)
    assert job.status == JobStatus.FAILED
    assert job.last_error == "attempt 2 failed: CUDA out of memory; retries exhausted (1 of 1 used)"
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.IDLE, None)


def test_worker_stopping_a_job_on_its_own_requeues_it_spending_a_retry(report):
    worker = WorkerFactory(stream_id=None)
    job = job_on_worker(worker)

    report(worker, job, "cancelled", error="agent shutting down")

    job = _reload(job)
    assert (job.status, job.retry_count, job.worker_id) == (JobStatus.QUEUED, 1, None)
    assert JobAttempt.objects.get(job=job).outcome == AttemptOutcome.CANCELLED
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.IDLE, None)


# --- the agent's side of cancellation -----------------------------------------------------------------


@pytest.mark.parametrize("reported", ["cancelled", "failed", "completed"])
def test_report_after_cancel_frees_the_worker_and_keeps_the_job_cancelled(report, commit, operator_client, reported):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    assert operator_client.post(f"/api/queue/{job.pk}/cancel").status_code == 200
    following = JobFactory()

    with commit():
        response = report(worker, job, reported)

    assert response.json() == {"job_id": job.pk, "status": "cancelled", "accepted": True}
    assert _reload(job).status == JobStatus.CANCELLED
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.BUSY, following.pk)
    # the operator's job_cancel (stored in the cancel's transaction), then the next job
    assert [e["type"] for e in sent_events(worker.pk)] == ["job_cancel", "job_submit"]


def test_running_report_after_cancel_is_refused_and_the_cancel_resent(report, commit, operator_client):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    with commit():
        operator_client.post(f"/api/queue/{job.pk}/cancel")

    with commit():
        response = report(worker, job, "running")

    assert response.status_code == 409
    assert response.json()["code"] == "job_cancelled"
    assert [e["type"] for e in sent_events(worker.pk)] == ["job_cancel", "job_cancel"]
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.BUSY, job.pk)
    (refused,) = audit_rows(actions.JOB_REPORT_REFUSED, target_id=job.pk)
    assert refused.success is False
