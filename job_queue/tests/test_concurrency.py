"""Dispatch and reports racing each other on real PostgreSQL row locks (skipped on SQLite)."""

import random
import threading
import time
from collections import Counter

import pytest
from django.db import connection

from audit import actions
from audit.services import Actor
from job_queue import agents, reports
from job_queue.models import Job, JobAttempt, JobStatus
from job_queue.dispatch import dispatch_for_job, dispatch_for_worker, dispatch_pending
from job_queue.reports import job_report
from job_queue.tests.factories import JobFactory, job_on_worker
from workers import services as worker_services
from workers.models import Worker, WorkerStatus
from job_queue.agents import worker_heartbeat
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows, sent_events
from tests.services import another_backend_waits_for_a_lock

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

THREADS = 8
JOBS = 20
WORKERS = 10
DEADLINE_S = 30


def holder(hold, holding, done):
    """Return a function that runs ``hold()`` in an audited transaction, then sets ``holding`` and keeps the
    transaction (and the rows ``hold`` locked) open until ``done`` is set or another backend waits for a lock."""
    from audit.services import audited_atomic

    def run():
        with audited_atomic():
            hold()
            holding.set()
            deadline = time.monotonic() + DEADLINE_S
            while not (done.is_set() or another_backend_waits_for_a_lock()):
                assert time.monotonic() < deadline, "the other side neither finished nor waited for a lock"
                time.sleep(0.005)
        return "committed"

    return run


def run_concurrently(functions):
    """Start ``functions`` together in threads; return their results; re-raise the first error."""
    barrier = threading.Barrier(len(functions))
    results = [None] * len(functions)
    errors = []

    def runner(index, function):
        try:
            barrier.wait(timeout=DEADLINE_S)
            results[index] = function()
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=runner, args=(i, f), daemon=True) for i, f in enumerate(functions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=DEADLINE_S)
    assert not any(t.is_alive() for t in threads), "a thread is stuck (lock wait?)"
    if errors:
        raise errors[0]
    return results


def test_concurrent_dispatchers_never_double_dispatch(postgres_url):
    jobs = [JobFactory(priority=random.randint(0, 3)) for _ in range(JOBS)]
    workers = WorkerFactory.create_batch(WORKERS)
    job_ids = [j.pk for j in jobs]
    worker_ids = [w.pk for w in workers]

    # Each dispatcher makes passes until one finds nothing to do: a row another thread held
    # (skip_locked) is tried again on the next pass, as the periodic dispatch_pending would.
    def pending():
        while dispatch_pending():
            pass

    def by_job():
        while any([dispatch_for_job(job_id) for job_id in random.sample(job_ids, len(job_ids))]):
            pass

    def by_worker():
        while any([dispatch_for_worker(worker_id) for worker_id in random.sample(worker_ids, len(worker_ids))]):
            pass

    kinds = [pending, by_job, by_worker]
    run_concurrently([kinds[i % len(kinds)] for i in range(THREADS)])

    dispatched = list(Job.objects.filter(status=JobStatus.DISPATCHED))
    assert len(dispatched) == WORKERS
    assert Job.objects.filter(status=JobStatus.QUEUED).count() == JOBS - WORKERS
    # No worker holds two jobs, and each dispatched job is held by the worker it names.
    assert len({job.worker_id for job in dispatched}) == len(dispatched)
    holders = {w.current_job_id: w.pk for w in Worker.objects.all()}
    assert all(holders.get(job.pk) == job.worker_id for job in dispatched)
    assert set(Worker.objects.values_list("status", flat=True)) == {WorkerStatus.BUSY}
    # Exactly one attempt, one audit row and one job_submit per dispatched job.
    assert JobAttempt.objects.count() == len(dispatched)
    assert all(job.attempt_count == 1 for job in dispatched)
    assert len(audit_rows(actions.JOB_DISPATCHED)) == len(dispatched)
    submits = [e for e in sent_events() if e["type"] == "job_submit"]
    assert Counter(e["data"]["job_id"] for e in submits) == Counter({job.pk: 1 for job in dispatched})
    assert Counter(e["channel"] for e in submits) == Counter({f"worker-{w}": 1 for w in worker_ids})


def test_concurrent_dispatch_with_more_workers_than_jobs(postgres_url):
    jobs = JobFactory.create_batch(5)
    WorkerFactory.create_batch(12)

    def pending():
        while dispatch_pending():
            pass

    run_concurrently([pending] * THREADS)

    assert Job.objects.filter(status=JobStatus.DISPATCHED).count() == len(jobs)
    assert Worker.objects.filter(status=WorkerStatus.BUSY).count() == len(jobs)
    assert JobAttempt.objects.count() == len(jobs)



def hold_worker_lock_until_another_waits(monkeypatch):
    """Patch the worker row lock so the calling thread, once registered, keeps it until another blocks.

    Return ``(enlist, holding)``: call ``enlist()`` in the thread that should hold the lock;
    ``holding`` is set once it holds it.
    """
    holding = threading.Event()
    holders = []
    real_lock_worker = worker_services.lock_worker

    def lock_worker_then_wait(worker_id):
        locked = real_lock_worker(worker_id)
        if threading.current_thread() in holders:
            holding.set()
            deadline = time.monotonic() + DEADLINE_S
            while not another_backend_waits_for_a_lock():
                assert time.monotonic() < deadline, "the status report never blocked"
                time.sleep(0.005)
        return locked

    monkeypatch.setattr(agents, "lock_worker", lock_worker_then_wait)
    return (lambda: holders.append(threading.current_thread())), holding


def test_status_report_and_heartbeat_of_one_worker_do_not_deadlock(postgres_url, monkeypatch):
    """The agent's heartbeat (worker row, then its job) and its status report race.

    The heartbeat is held right after it locks the worker until the report is blocked behind it;
    both must then complete (lock order worker -> job everywhere), not die in a deadlock.
    """
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING)
    actor = Actor.for_worker(worker)
    enlist, heartbeat_holds_worker = hold_worker_lock_until_another_waits(monkeypatch)

    def heartbeat():
        enlist()
        return worker_heartbeat(
            worker_id=worker.pk, data={"current_job_id": job.pk, "progress": {"step": 7}}, actor=actor
        )

    def report():
        assert heartbeat_holds_worker.wait(DEADLINE_S)
        return job_report(worker_id=worker.pk, job_id=job.pk, data={"status": "completed"}, actor=actor)

    beat, reported = run_concurrently([heartbeat, report])

    assert beat["current_job_id"] == job.pk
    assert reported == {"job_id": job.pk, "status": "completed", "accepted": True}
    job.refresh_from_db()
    worker.refresh_from_db()
    assert job.status == JobStatus.COMPLETED
    assert (worker.status, worker.current_job_id) == (WorkerStatus.IDLE, None)


def test_register_and_status_report_of_one_worker_do_not_deadlock(postgres_url, monkeypatch):
    """A restarting agent re-registers (worker row, then its job) while its last report is in flight."""
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING)
    actor = Actor.for_worker(worker)
    enlist, register_holds_worker = hold_worker_lock_until_another_waits(monkeypatch)

    def register():
        enlist()
        return agents.worker_register(worker_id=worker.pk, data={"current_job_id": job.pk}, actor=actor)

    def report():
        assert register_holds_worker.wait(DEADLINE_S)
        return reports.job_report(
            worker_id=worker.pk, job_id=job.pk, data={"status": "running", "progress": 0.5}, actor=actor
        )

    registered, reported = run_concurrently([register, report])

    assert registered["resume_job"]["job_id"] == job.pk
    assert reported["status"] == "running"
    job.refresh_from_db()
    assert (job.status, job.progress) == (JobStatus.RUNNING, {"fraction": 0.5})


def test_a_drain_racing_a_transaction_that_holds_the_workers_job_does_not_deadlock(postgres_url):
    """Seen in CI: a drain writes its busy worker twice, so PostgreSQL checks the worker's foreign key to
    its job (a deferred check: KEY SHARE on the job's row). Another transaction holds the job's row and
    then writes an audit row (the chain's head). Were the check left to the drain's commit, the drain
    would hold the head while waiting for the job, and the other would wait for the head: a deadlock.
    The drain's checks run before it takes the head, so it waits for the job and both complete."""
    from audit.services import audit_record, audited_atomic
    from job_queue.services import lock_job

    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING)
    operator = Actor.system("operator")
    holds_job = threading.Event()

    def holder_of_the_job():
        with audited_atomic():
            lock_job(job.pk)
            holds_job.set()
            deadline = time.monotonic() + DEADLINE_S
            while not another_backend_waits_for_a_lock():  # the drain waits for the job's row
                assert time.monotonic() < deadline, "the drain never waited for the job's row"
                time.sleep(0.005)
            audit_record(actor=operator, action="job.probe", target_type="job", target_id=job.pk)
        return "committed"

    def drain():
        assert holds_job.wait(DEADLINE_S)
        return worker_services.worker_drain(worker_id=worker.pk, actor=operator)

    committed, drained = run_concurrently([holder_of_the_job, drain])

    assert committed == "committed" and drained.status == WorkerStatus.DRAINING
    assert audit_rows("job.probe") and audit_rows(actions.WORKER_DRAIN_REQUESTED)


def test_a_job_submitted_while_its_worker_is_held_is_dispatched_once_the_holder_commits(postgres_url):
    """The lost wake-up: a freed worker's offer (it holds the worker's row) reads the queue before a
    submit commits and finds nothing; the submit's dispatch skips the held worker (SKIP LOCKED) and
    finds no other. Both commit empty-handed, and the job would wait for the next periodic pass
    (HEALTH_CHECK_INTERVAL, a minute). The submit saw a worker it could have had, held by another
    transaction: after its commit it waits for that worker's row and takes it once the holder commits."""
    from audit.services import audited_atomic
    from job_queue.services import job_submit

    worker = WorkerFactory()
    holding, submitted = threading.Event(), threading.Event()

    def hold():
        assert dispatch_for_worker(worker.pk) is None  # the queue is empty: nothing yet; the row stays locked

    offer_to_freed_worker = holder(hold, holding, submitted)

    def submit():
        assert holding.wait(DEADLINE_S)
        try:
            return job_submit(config_name="cfg", actor=Actor.system("operator"))
        finally:
            submitted.set()

    committed, (job, dispatched_at_once) = run_concurrently([offer_to_freed_worker, submit])

    assert committed == "committed" and not dispatched_at_once
    job.refresh_from_db()
    worker.refresh_from_db()
    assert job.status == JobStatus.DISPATCHED and job.worker_id == worker.pk
    assert worker.status == WorkerStatus.BUSY and worker.current_job_id == job.pk
    assert JobAttempt.objects.filter(job=job).count() == 1
    assert len(audit_rows(actions.JOB_DISPATCHED)) == 1

