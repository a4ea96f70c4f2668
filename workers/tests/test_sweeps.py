"""The health sweep: stale workers go offline and their jobs are recovered by the retry rules."""

from datetime import timedelta

import pytest
from django.utils import timezone

from audit.models import AuditEvent
from job_queue.models import AttemptOutcome, Job, JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import Worker, WorkerStatus
from workers.sweeps import sweep_stale_workers

from .factories import WorkerFactory

pytestmark = pytest.mark.django_db


def stale(**kwargs):
    return WorkerFactory(last_heartbeat=timezone.now() - timedelta(seconds=600), **kwargs)


def test_fresh_workers_are_left_alone():
    worker = WorkerFactory()
    assert sweep_stale_workers() == {"workers": 0, "requeued": 0, "failed": 0}
    worker.refresh_from_db()
    assert worker.status == WorkerStatus.IDLE


def test_stale_workers_go_offline_draining_ones_included_and_are_audited():
    idle, draining = stale(), stale(draining=True)
    result = sweep_stale_workers()
    assert result["workers"] == 2
    assert set(Worker.objects.values_list("status", flat=True)) == {WorkerStatus.OFFLINE}
    rows = AuditEvent.objects.filter(action="worker.status_changed", target_id__in=[idle.pk, draining.pk])
    assert {(r.target_id, r.details["from"], r.details["to"]) for r in rows} == {
        (idle.pk, "idle", "offline"),
        (draining.pk, "draining", "offline"),
    }
    # The drain intent survives going offline: the worker comes back draining.
    assert Worker.objects.get(pk=draining.pk).drain_requested_at is not None


def test_running_job_is_requeued_spending_a_retry_and_goes_to_the_next_idle_worker(django_capture_on_commit_callbacks):
    lost = stale()
    job = job_on_worker(lost, status=JobStatus.RUNNING)
    spare = WorkerFactory()
    with django_capture_on_commit_callbacks(execute=True):
        result = sweep_stale_workers()
    assert result == {"workers": 1, "requeued": 1, "failed": 0}
    job.refresh_from_db()
    assert job.retry_count == 1
    assert job.status == JobStatus.DISPATCHED and job.worker_id == spare.pk
    assert job.attempts.get(number=1).outcome == AttemptOutcome.LOST
    assert Worker.objects.get(pk=lost.pk).current_job_id is None
    assert AuditEvent.objects.filter(action="job.requeued", target_id=job.pk, details__retry_spent=True).exists()


def test_unacknowledged_dispatch_is_requeued_without_spending_a_retry():
    job = job_on_worker(stale(), status=JobStatus.DISPATCHED)
    sweep_stale_workers()
    job.refresh_from_db()
    assert (job.status, job.retry_count, job.worker_id, job.lease_id) == (JobStatus.QUEUED, 0, None, None)
    assert job.attempts.get().outcome == AttemptOutcome.UNACKNOWLEDGED


def test_job_out_of_retries_fails_for_good_with_the_reason():
    job = job_on_worker(stale(), status=JobStatus.RUNNING, retry_count=3, max_retries=3)
    assert sweep_stale_workers()["failed"] == 1
    job.refresh_from_db()
    assert job.status == JobStatus.FAILED
    assert "retries exhausted" in job.last_error and job.finished_at is not None


def test_other_jobs_are_untouched():
    queued = JobFactory()
    done = JobFactory(status=JobStatus.COMPLETED)
    sweep_stale_workers()
    assert Job.objects.get(pk=queued.pk).status == JobStatus.QUEUED
    assert Job.objects.get(pk=done.pk).status == JobStatus.COMPLETED


def test_sweep_cost_does_not_grow_with_the_fleet(django_assert_max_num_queries):
    for _ in range(30):
        job_on_worker(stale(), status=JobStatus.RUNNING)
    # A fixed number of statements, whatever the number of stale workers and jobs.
    with django_assert_max_num_queries(14):
        assert sweep_stale_workers()["workers"] == 30
