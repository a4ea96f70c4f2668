"""The ack sweep and the ephemeral cleanup racing themselves and requests on real PostgreSQL row locks."""

import threading
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.utils import timezone

from audit import actions
from audit.services import Actor
from job_queue.models import AttemptOutcome, Job, JobAttempt, JobStatus
from job_queue.reports import job_report
from job_queue.sweeps import sweep_unacknowledged_dispatches
from job_queue.tests.factories import job_on_worker
from job_queue.tests.test_concurrency import DEADLINE_S, run_concurrently
from common.errors import StaleReport
from workers.models import Token, Worker, WorkerStatus, WorkerType
from workers.sweeps import sweep_offline_ephemeral_workers
from workers.tests.factories import WorkerFactory, worker_token
from workers.tests.support import audit_rows

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

LONG_AGO = timedelta(hours=2)
SWEEPERS = 6


def lost_dispatch(worker):
    job = job_on_worker(worker, status=JobStatus.DISPATCHED)
    Job.objects.filter(pk=job.pk).update(dispatched_at=timezone.now() - LONG_AGO)
    job.refresh_from_db()
    return job


def gone_ephemeral():
    worker = WorkerFactory(worker_type=WorkerType.EPHEMERAL, offline=True)
    Worker.objects.filter(pk=worker.pk).update(status_changed_at=timezone.now() - LONG_AGO)
    worker_token(worker)
    return worker


@contextmanager
def row_locked(queryset):
    """Hold ``SELECT ... FOR UPDATE`` on ``queryset``'s rows in another connection for the block's duration."""
    locked, release, errors = threading.Event(), threading.Event(), []

    def hold():
        try:
            with transaction.atomic():
                assert list(queryset.select_for_update())
                locked.set()
                release.wait(DEADLINE_S)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            locked.set()
        finally:
            connection.close()

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert locked.wait(DEADLINE_S) and not errors, errors
    try:
        yield
    finally:
        release.set()
        thread.join(DEADLINE_S)
    assert not errors, errors


def sweep_until_idle(sweep, key):
    """Run ``sweep`` until a run finds nothing (rows another sweep held are retried); return the total."""
    total = 0
    while (done := sweep()[key]) > 0:
        total += done
    return total


def test_ack_sweeps_running_together_requeue_each_job_exactly_once(postgres_url):
    jobs = [lost_dispatch(WorkerFactory(stream_id=None)) for _ in range(20)]  # no stream: none is redispatched

    totals = run_concurrently([lambda: sweep_until_idle(sweep_unacknowledged_dispatches, "jobs")] * SWEEPERS)

    assert sum(totals) == len(jobs)
    assert set(Job.objects.values_list("status", flat=True)) == {JobStatus.QUEUED}
    assert set(JobAttempt.objects.values_list("outcome", flat=True)) == {AttemptOutcome.UNACKNOWLEDGED}
    assert Counter(r.target_id for r in audit_rows(actions.JOB_REQUEUED)) == Counter({j.pk: 1 for j in jobs})
    assert len(audit_rows(actions.WORKER_STATUS_CHANGED)) == len(jobs)
    assert set(Worker.objects.values_list("status", "current_job")) == {(WorkerStatus.IDLE, None)}


def test_ack_sweep_skips_a_job_or_worker_locked_by_a_request_and_takes_them_next_time(postgres_url):
    held_job, on_held_worker, free = (lost_dispatch(WorkerFactory(stream_id=None)) for _ in range(3))

    with row_locked(Job.objects.filter(pk=held_job.pk)), row_locked(Worker.objects.filter(pk=on_held_worker.worker_id)):
        assert sweep_unacknowledged_dispatches() == {"jobs": 1, "workers_freed": 1}  # returns at once, no waiting
        statuses = dict(Job.objects.values_list("pk", "status"))
        assert statuses == {held_job.pk: "dispatched", on_held_worker.pk: "dispatched", free.pk: "queued"}

    assert sweep_unacknowledged_dispatches() == {"jobs": 2, "workers_freed": 2}
    assert set(Job.objects.values_list("status", flat=True)) == {JobStatus.QUEUED}


def test_a_late_acknowledgement_racing_the_ack_sweep_either_wins_or_is_refused(postgres_url):
    outcomes = Counter()
    for _ in range(10):
        worker = WorkerFactory()
        job = lost_dispatch(worker)
        lease = job.lease_id
        actor = Actor.for_worker(worker)

        def acknowledge():
            try:
                return job_report(worker_id=worker.pk, job_id=job.pk, data={"status": "starting", "attempt": lease}, actor=actor)
            except StaleReport as exc:
                return exc.code

        _, acked = run_concurrently([sweep_unacknowledged_dispatches, acknowledge])

        job.refresh_from_db()
        worker.refresh_from_db()
        attempt = JobAttempt.objects.get(lease_id=lease)
        if isinstance(acked, dict):  # the ack won: the sweep no longer saw a dispatched job
            outcomes["acked"] += 1
            assert (job.status, job.lease_id, attempt.outcome) == (JobStatus.RUNNING, lease, "")
            assert (worker.status, worker.current_job_id) == (WorkerStatus.BUSY, job.pk)
        else:  # the sweep won: the old attempt is over, whatever happened to the job next
            outcomes["refused"] += 1
            assert acked in {"job_not_owned", "stale_attempt"}
            assert attempt.outcome == AttemptOutcome.UNACKNOWLEDGED
            assert job.lease_id != lease and job.status in {JobStatus.QUEUED, JobStatus.DISPATCHED}
            assert worker.current_job_id in {None, job.pk}
        Job.objects.filter(pk=job.pk).update(status=JobStatus.COMPLETED)
        Worker.objects.filter(pk=worker.pk).update(status=WorkerStatus.OFFLINE, current_job=None)
    assert sum(outcomes.values()) == 10, outcomes


def test_cleanup_sweeps_running_together_delete_each_worker_exactly_once(postgres_url):
    workers = [gone_ephemeral() for _ in range(20)]

    totals = run_concurrently([lambda: sweep_until_idle(sweep_offline_ephemeral_workers, "workers")] * SWEEPERS)

    assert sum(totals) == len(workers)
    assert not Worker.objects.exists() and not Token.objects.exists()
    assert Counter(r.target_id for r in audit_rows(actions.WORKER_DELETED)) == Counter({w.pk: 1 for w in workers})


def test_cleanup_skips_a_worker_whose_row_a_request_holds(postgres_url):
    coming_back, gone = gone_ephemeral(), gone_ephemeral()

    with row_locked(Worker.objects.filter(pk=coming_back.pk)):
        assert sweep_offline_ephemeral_workers() == {"workers": 1}

    assert list(Worker.objects.values_list("pk", flat=True)) == [coming_back.pk]
    assert [r.target_id for r in audit_rows(actions.WORKER_DELETED)] == [gone.pk]


def test_heartbeat_sweep_leaves_a_worker_whose_job_is_held_elsewhere_for_the_next_run(postgres_url):
    from job_queue.sweeps import sweep_stale_workers

    silent = timezone.now() - timedelta(seconds=600)
    held_worker, free_worker = WorkerFactory(last_heartbeat=silent), WorkerFactory(last_heartbeat=silent)
    held_job = job_on_worker(held_worker, status=JobStatus.RUNNING)
    free_job = job_on_worker(free_worker, status=JobStatus.RUNNING)

    with row_locked(Job.objects.filter(pk=held_job.pk)):  # e.g. an operator's cancel in flight
        assert sweep_stale_workers()["workers"] == 1
        held_worker.refresh_from_db()
        # Not taken offline with its job still pointing at it: nothing would ever recover that job.
        assert (held_worker.status, held_worker.current_job_id) == (WorkerStatus.BUSY, held_job.pk)

    assert sweep_stale_workers() == {"workers": 1, "requeued": 1, "failed": 0}
    held_job.refresh_from_db()
    free_job.refresh_from_db()
    assert (held_job.status, held_job.worker_id, held_job.retry_count) == (JobStatus.QUEUED, None, 1)
    assert free_job.status == JobStatus.QUEUED
