"""Exactly once, server side: the one acknowledgement rule, the ack sweep after a restart, late completions."""

from datetime import timedelta

import pytest
from django.utils import timezone

from audit import actions
from job_queue.models import AttemptOutcome, Job, JobAttempt, JobStatus
from job_queue.sweeps import sweep_stale_workers, sweep_unacknowledged_dispatches
from job_queue.tests.factories import job_on_worker
from job_queue.tests.test_sweeps import lost_dispatch
from workers.models import ServerPresence, Worker, WorkerStatus
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

HEARTBEAT = "/api/workers/heartbeat"
REGISTER = "/api/workers/register"


def _reload(obj):
    obj.refresh_from_db()
    return obj


def _status_path(job):
    return f"/api/workers/job/{job.pk}/status"


# --- one acknowledgement rule ----------------------------------------------------------------------


def test_a_heartbeat_naming_the_dispatched_job_acknowledges_it_and_the_ack_sweep_leaves_it(worker_client):
    """The deterministic repro: job_submit received, `starting` never sent, heartbeats name the job."""
    worker = WorkerFactory()
    job = lost_dispatch(worker)  # dispatched 10 minutes ago, never said `starting`
    client = worker_client(worker)

    for _ in range(3):
        response = client.post(HEARTBEAT, {"status": "busy", "current_job_id": job.pk}, format="json")
        assert response.status_code == 200, response.content

    assert sweep_unacknowledged_dispatches() == {"jobs": 0, "workers_freed": 0}
    job = _reload(job)
    assert (job.status, job.lease_id, job.retry_count) == (JobStatus.RUNNING, job.lease_id, 0)
    assert JobAttempt.objects.get(lease_id=job.lease_id).started_at is not None
    changes = [r.details for r in audit_rows(actions.JOB_STATUS_CHANGED, target_id=job.pk)]
    assert changes == [
        {"from": "dispatched", "to": "running", "reason": "heartbeat names the job", "attempt": 1, "worker": worker.pk}
    ]


def test_a_heartbeat_naming_another_attempt_of_the_job_does_not_acknowledge_it(worker_client):
    worker = WorkerFactory()
    job = lost_dispatch(worker)

    response = worker_client(worker).post(
        HEARTBEAT, {"status": "busy", "current_job_id": job.pk, "attempt": "a_someoldattempt"}, format="json"
    )

    assert response.status_code == 200
    # The answer says which attempt the worker holds, so the agent knows its own was not acknowledged.
    assert (response.json()["current_job_id"], response.json()["current_attempt"]) == (job.pk, job.lease_id)
    assert _reload(job).status == JobStatus.DISPATCHED
    assert sweep_unacknowledged_dispatches()["jobs"] == 1


def test_a_heartbeat_naming_the_job_and_its_attempt_acknowledges_it(worker_client):
    worker = WorkerFactory()
    job = lost_dispatch(worker)

    response = worker_client(worker).post(
        HEARTBEAT, {"status": "busy", "current_job_id": job.pk, "attempt": job.lease_id}, format="json"
    )

    assert response.status_code == 200
    assert _reload(job).status == JobStatus.RUNNING


def test_a_failed_report_of_a_never_acknowledged_attempt_counts_as_acknowledged(worker_client):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.DISPATCHED, retry_on_failure=True)

    response = worker_client(worker).post(
        _status_path(job), {"status": "failed", "attempt": job.lease_id, "error": "boom"}, format="json"
    )

    assert response.status_code == 200
    job = _reload(job)
    assert (job.status, job.retry_count) == (JobStatus.QUEUED, 1)  # the trainer ran: a retry is spent
    (attempt,) = JobAttempt.objects.filter(job=job)
    assert attempt.outcome == AttemptOutcome.FAILED


# --- the ack sweep after a restart -----------------------------------------------------------------


def _server_up_for(seconds):
    now = timezone.now()
    ServerPresence.objects.create(
        pk="host:1:x", hostname="host", pid=1, started_at=now - timedelta(seconds=seconds), last_seen=now
    )


def test_the_ack_sweep_holds_back_until_a_server_has_been_up_for_a_whole_ack_timeout(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "DISPATCH_ACK_TIMEOUT": 5}
    job = lost_dispatch(WorkerFactory(), age=timedelta(seconds=30))
    _server_up_for(2)  # restarted 2 s ago: agents are still reconnecting

    assert sweep_unacknowledged_dispatches() == {"jobs": 0, "workers_freed": 0}
    assert _reload(job).status == JobStatus.DISPATCHED

    ServerPresence.objects.update(started_at=timezone.now() - timedelta(seconds=6))
    assert sweep_unacknowledged_dispatches() == {"jobs": 1, "workers_freed": 1}
    assert _reload(job).status == JobStatus.QUEUED


def test_the_ack_sweep_holds_back_while_no_server_is_up(settings):
    job = lost_dispatch(WorkerFactory())
    ServerPresence.objects.create(
        pk="host:1:x", hostname="host", pid=1, started_at=timezone.now() - timedelta(hours=1),
        last_seen=timezone.now() - timedelta(minutes=10),
    )

    assert sweep_unacknowledged_dispatches()["jobs"] == 0
    assert _reload(job).status == JobStatus.DISPATCHED


# --- a late completion of a lost attempt -----------------------------------------------------------


def _lost_running_job(worker, settings):
    """A running job whose worker went silent: the stale sweep requeued it, spending a retry."""
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "HEARTBEAT_TIMEOUT": 30}
    job = job_on_worker(worker, status=JobStatus.RUNNING)
    Worker.objects.filter(pk=worker.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    assert sweep_stale_workers()["requeued"] == 1
    job = _reload(job)
    assert (job.status, job.retry_count, job.lease_id) == (JobStatus.QUEUED, 1, None)
    return job


def test_a_late_completion_of_a_lost_attempt_completes_the_job_and_cancels_the_requeue(worker_client, settings):
    worker = WorkerFactory()
    job = _lost_running_job(worker, settings)
    (attempt,) = JobAttempt.objects.filter(job=job)
    assert attempt.outcome == AttemptOutcome.LOST

    response = worker_client(worker).post(
        _status_path(job),
        {"status": "completed", "attempt": attempt.lease_id, "exit_code": 0, "log_tail": ["done"]},
        format="json",
    )

    assert response.status_code == 200, response.content
    assert response.json() == {"job_id": job.pk, "status": "completed", "accepted": True}
    job = _reload(job)
    assert (job.status, job.retry_count, job.lease_id, job.worker_id) == (
        JobStatus.COMPLETED, 0, attempt.lease_id, worker.pk,
    )
    assert (job.exit_code, job.log_tail, job.progress["fraction"]) == (0, "done", 1.0)
    assert _reload(attempt).outcome == AttemptOutcome.COMPLETED
    (recovered,) = audit_rows(actions.JOB_COMPLETION_RECOVERED, target_id=job.pk)
    assert recovered.details == {
        "attempt": 1, "lease": attempt.lease_id, "was": "lost", "retry_refunded": True, "journal": False,
    }
    # Nothing dispatches it again.
    assert Job.objects.get(pk=job.pk).attempt_count == 1


def _dispatched_again(job, settings, first):
    """``first``'s attempt of ``job`` is lost; the job is dispatched again to another worker: return it and its lease."""
    from job_queue.dispatch import dispatch_for_job

    second = WorkerFactory(name="second")
    Worker.objects.filter(pk=second.pk).update(status=WorkerStatus.IDLE, stream_id="s-2", last_heartbeat=timezone.now())
    assert dispatch_for_job(job.pk).pk == second.pk
    return second, _reload(job).lease_id


@pytest.mark.parametrize("acknowledged", [False, True], ids=["dispatched", "running"])
def test_a_late_completion_supersedes_the_attempt_that_runs_the_job_meanwhile(
    worker_client, settings, django_capture_on_commit_callbacks, acknowledged
):
    """The soak's twice-completed job: attempt 1 completed while its worker was lost; attempt 2 runs
    elsewhere when the result arrives. The job completes with attempt 1; attempt 2 is superseded, its
    worker freed and told to stop, so its trainer does not complete a second time."""
    first = WorkerFactory(name="first")
    job = _lost_running_job(first, settings)
    old_lease = JobAttempt.objects.get(job=job).lease_id
    second, new_lease = _dispatched_again(job, settings, first)
    if acknowledged:
        assert worker_client(second).post(_status_path(job), {"status": "starting", "attempt": new_lease}, format="json").status_code == 200

    with django_capture_on_commit_callbacks(execute=True):
        response = worker_client(first).post(
            _status_path(job), {"status": "completed", "attempt": old_lease, "journal": True}, format="json"
        )

    assert response.status_code == 200, response.content
    job = _reload(job)
    assert (job.status, job.lease_id, job.worker_id, job.retry_count) == (JobStatus.COMPLETED, old_lease, first.pk, 0)
    outcomes = dict(JobAttempt.objects.filter(job=job).values_list("lease_id", "outcome"))
    assert outcomes == {old_lease: AttemptOutcome.COMPLETED, new_lease: AttemptOutcome.SUPERSEDED}
    second = _reload(second)
    assert (second.status, second.current_job_id) == (WorkerStatus.IDLE, None)
    (recovered,) = audit_rows(actions.JOB_COMPLETION_RECOVERED, target_id=job.pk)
    assert recovered.details["superseded"] == new_lease
    from workers.tests.support import sent_events

    cancels = [e for e in sent_events(second.pk) if e["type"] == "job_cancel"]
    assert [(e["data"]["job_id"], e["data"]["attempt"]) for e in cancels] == [(job.pk, new_lease)]

    # The superseded attempt's own report is refused: the job is not its worker's any more.
    late = worker_client(second).post(_status_path(job), {"status": "cancelled", "attempt": new_lease}, format="json")
    assert late.status_code == 409
    assert _reload(job).status == JobStatus.COMPLETED


def test_once_another_attempt_has_completed_the_job_the_late_completion_is_refused_and_recorded(worker_client, settings):
    first = WorkerFactory(name="first")
    job = _lost_running_job(first, settings)
    old_lease = JobAttempt.objects.get(job=job).lease_id
    second, new_lease = _dispatched_again(job, settings, first)
    for status in ("starting", "completed"):
        assert worker_client(second).post(_status_path(job), {"status": status, "attempt": new_lease}, format="json").status_code == 200

    response = worker_client(first).post(_status_path(job), {"status": "completed", "attempt": old_lease}, format="json")

    assert response.status_code == 409
    assert response.json()["code"] == "job_not_owned"
    job = _reload(job)
    assert (job.status, job.lease_id) == (JobStatus.COMPLETED, new_lease)
    (refused,) = audit_rows(actions.JOB_REPORT_REFUSED, target_id=job.pk)
    assert refused.details["attempt"] == old_lease


def test_only_the_worker_that_ran_the_lost_attempt_can_complete_it(worker_client, settings):
    worker, other = WorkerFactory(name="ran-it"), WorkerFactory(name="other")
    job = _lost_running_job(worker, settings)
    lease = JobAttempt.objects.get(job=job).lease_id

    response = worker_client(other).post(_status_path(job), {"status": "completed", "attempt": lease}, format="json")

    assert response.status_code == 409
    assert _reload(job).status == JobStatus.QUEUED


def test_a_late_failure_of_a_lost_attempt_is_still_refused(worker_client, settings):
    worker = WorkerFactory()
    job = _lost_running_job(worker, settings)
    lease = JobAttempt.objects.get(job=job).lease_id

    response = worker_client(worker).post(_status_path(job), {"status": "failed", "attempt": lease}, format="json")

    assert response.status_code == 409
    assert _reload(job).status == JobStatus.QUEUED


def _failed_by_its_loss(worker, settings):
    """A running job with no retry left whose worker went silent: the stale sweep failed it for good."""
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "HEARTBEAT_TIMEOUT": 30}
    job = job_on_worker(worker, status=JobStatus.RUNNING, max_retries=1, retry_count=1)
    Worker.objects.filter(pk=worker.pk).update(last_heartbeat=timezone.now() - timedelta(minutes=5))
    assert sweep_stale_workers()["requeued"] == 0
    job = _reload(job)
    assert (job.status, job.retry_count) == (JobStatus.FAILED, 1) and "retries exhausted" in job.last_error
    return job


def test_a_late_completion_of_the_attempt_whose_loss_failed_the_job_completes_it(worker_client, settings):
    """The soak's finding B: the trainer completed, but its worker went silent before the result arrived and the
    job, with no retry left, failed for good. The result, arriving late from the agent's journal, is fact:
    the job completes with that attempt, and no retry is refunded (none was spent)."""
    worker = WorkerFactory()
    job = _failed_by_its_loss(worker, settings)
    attempt = JobAttempt.objects.get(job=job)
    assert (attempt.outcome, job.lease_id) == (AttemptOutcome.LOST, attempt.lease_id)

    response = worker_client(worker).post(
        _status_path(job), {"status": "completed", "attempt": attempt.lease_id, "journal": True}, format="json"
    )

    assert response.status_code == 200, response.content
    assert response.json()["status"] == "completed"
    job = _reload(job)
    assert (job.status, job.retry_count, job.last_error, job.lease_id) == (JobStatus.COMPLETED, 1, "", attempt.lease_id)
    assert _reload(attempt).outcome == AttemptOutcome.COMPLETED
    (recovered,) = audit_rows(actions.JOB_COMPLETION_RECOVERED, target_id=job.pk)
    assert recovered.details["failure_undone"] is True and recovered.details["retry_refunded"] is False
    assert Job.objects.get(pk=job.pk).attempt_count == 1


def test_a_job_failed_by_its_trainer_or_by_another_workers_word_stays_failed(worker_client, settings):
    """Only a failure the loss alone caused is undone by a completion: not the trainer's own failure report, nor
    by a completion claimed by a worker that did not run the attempt, nor once an operator retried the job (the
    retry runs it again). A late failure agrees with it."""
    worker, other = WorkerFactory(name="ran-it"), WorkerFactory(name="other")
    lost = _failed_by_its_loss(worker, settings)
    lease = lost.lease_id
    assert worker_client(other).post(_status_path(lost), {"status": "completed", "attempt": lease}, format="json").status_code == 409
    assert worker_client(worker).post(_status_path(lost), {"status": "failed", "attempt": lease}, format="json").status_code == 200
    lost = _reload(lost)
    assert (lost.status, lost.retry_count) == (JobStatus.FAILED, 1)
    assert JobAttempt.objects.get(job=lost).outcome == AttemptOutcome.LOST

    retried = _failed_by_its_loss(WorkerFactory(name="retried"), settings)
    from audit.services import Actor
    from job_queue.services import job_retry

    again, _ = job_retry(job_id=retried.pk, actor=Actor.system("operator"))  # the operator runs it again: a new job
    response = worker_client(retried.worker).post(
        _status_path(retried), {"status": "completed", "attempt": retried.lease_id}, format="json"
    )
    assert response.status_code == 409
    assert _reload(retried).status == JobStatus.FAILED
    assert _reload(again).status in (JobStatus.QUEUED, JobStatus.DISPATCHED)  # the retry runs it

    ran = job_on_worker(WorkerFactory(name="trainer-failed"), status=JobStatus.RUNNING, max_retries=0)
    client = worker_client(ran.worker)
    assert client.post(_status_path(ran), {"status": "failed", "attempt": ran.lease_id}, format="json").status_code == 200
    assert _reload(ran).status == JobStatus.FAILED
    assert client.post(_status_path(ran), {"status": "completed", "attempt": ran.lease_id}, format="json").status_code == 409
    assert _reload(ran).status == JobStatus.FAILED


def test_a_completion_read_back_from_the_agents_journal_says_so_in_the_audit_trail(worker_client):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING)

    response = worker_client(worker).post(
        _status_path(job), {"status": "completed", "attempt": job.lease_id, "journal": True}, format="json"
    )

    assert response.status_code == 200
    (completed,) = [r for r in audit_rows(actions.JOB_STATUS_CHANGED, target_id=job.pk) if r.details["to"] == "completed"]
    assert completed.details["reason"] == "completed (from the agent's journal)"
