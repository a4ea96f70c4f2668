"""jobs_transition enforces JOB_TRANSITIONS over every (from, to) pair and audits each change; a release is one UPDATE."""

import itertools

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext

from audit import actions
from audit.services import Actor, audit_batch
from common import updates
from job_queue.models import JOB_TERMINAL, JOB_TRANSITIONS, AttemptOutcome, Job, JobAttempt, JobStatus
from job_queue.transitions import jobs_release, jobs_transition
from job_queue.tests.factories import JobFactory, job_on_worker
from common.errors import InvalidTransition
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

ACTOR = Actor.system("test")
PAIRS = list(itertools.product(JobStatus.values, repeat=2))
ALLOWED = [(before, after) for before, after in PAIRS if before in JOB_TRANSITIONS[after]]
FORBIDDEN = [(before, after) for before, after in PAIRS if before not in JOB_TRANSITIONS[after]]


# The one way out of a finished status: a job its attempt's loss failed for good completes when that attempt's
# result arrives late (transitions.jobs_recover_completion, guarded by recoverable_attempt).
LEAVES_TERMINAL = {(JobStatus.FAILED, JobStatus.COMPLETED)}


def test_table_names_every_status_and_never_leaves_a_terminal_one():
    assert set(JOB_TRANSITIONS) == set(JobStatus.values)
    for before, after in ALLOWED:
        assert before not in JOB_TERMINAL or (before, after) in LEAVES_TERMINAL, f"{before} -> {after} reopens a finished job"
    assert len(ALLOWED) + len(FORBIDDEN) == len(JobStatus.values) ** 2


@pytest.mark.parametrize(("before", "after"), FORBIDDEN)
def test_forbidden_transition_raises_and_changes_nothing(before, after):
    job = JobFactory(status=before, last_error="original")

    with pytest.raises(InvalidTransition):
        jobs_transition(jobs=[job], to=after, actor=ACTOR, last_error="changed")

    stored = Job.objects.get(pk=job.pk)
    assert (stored.status, stored.last_error) == (before, "original")
    assert audit_rows() == []


@pytest.mark.parametrize(("before", "after"), ALLOWED)
def test_allowed_transition_writes_status_fields_and_one_audit_row(before, after):
    job = JobFactory(status=before, last_error="original", attempt_count=2)

    jobs_transition(jobs=[job], to=after, actor=ACTOR, reason="because", last_error="changed")

    stored = Job.objects.get(pk=job.pk)
    assert (stored.status, stored.last_error) == (after, "changed")
    (row,) = audit_rows()
    assert row.action == actions.JOB_STATUS_CHANGED
    assert row.target_id == job.pk
    assert row.details == {"from": before, "to": after, "reason": "because", "attempt": 2}


def test_transition_from_a_stale_copy_is_refused():
    job = JobFactory(status=JobStatus.QUEUED)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.CANCELLED)

    with pytest.raises(InvalidTransition):
        jobs_transition(jobs=[job], to=JobStatus.DISPATCHED, actor=ACTOR)

    assert Job.objects.get(pk=job.pk).status == JobStatus.CANCELLED
    assert audit_rows() == []


# --- jobs_release: one UPDATE of the attempts and one of the jobs, whatever their fates -------------


def _statements(captured, kind):
    """The statements that are ``kind`` (its start), or hold it after a WITH."""
    return [q["sql"] for q in captured.captured_queries if q["sql"].startswith(kind) or q["sql"].startswith("WITH") and kind in q["sql"]]


def _released_mix():
    """Jobs of every fate on lost workers: never acknowledged, retries left, retries used up."""
    unacked = job_on_worker(WorkerFactory(), status=JobStatus.DISPATCHED, retry_count=3, max_retries=3)
    retry = job_on_worker(WorkerFactory(), status=JobStatus.RUNNING, retry_count=1, max_retries=3)
    exhausted = job_on_worker(WorkerFactory(), status=JobStatus.RUNNING, retry_count=2, max_retries=2)
    return unacked, retry, exhausted


def _lost(job):
    return "worker lost before acknowledging" if job.status == JobStatus.DISPATCHED else "worker lost"


def test_a_release_of_every_fate_is_one_update_of_the_jobs_and_one_of_the_attempts():
    unacked, retry, exhausted = _released_mix()
    leases = {job.pk: job.lease_id for job in (unacked, retry, exhausted)}
    jobs = list(Job.objects.filter(pk__in=leases))

    with CaptureQueriesContext(connection) as captured, transaction.atomic(), audit_batch():
        released = jobs_release(jobs=jobs, actor=ACTOR, reason=_lost)

    assert len(_statements(captured, 'UPDATE "queue_job" ')) == 1
    assert len(_statements(captured, 'UPDATE "queue_jobattempt" ')) == 1
    assert len(_statements(captured, 'INSERT INTO "audit_auditevent"')) == 1
    assert sorted(released.requeued) == sorted([unacked.pk, retry.pk])
    assert released.failed == [exhausted.pk]
    stored = {job.pk: job for job in Job.objects.filter(pk__in=leases)}
    assert [(stored[j.pk].status, stored[j.pk].retry_count, stored[j.pk].worker_id) for j in (unacked, retry)] == [
        (JobStatus.QUEUED, 3, None),
        (JobStatus.QUEUED, 2, None),
    ]
    assert stored[unacked.pk].last_error == "worker lost before acknowledging"
    assert stored[retry.pk].last_error == "worker lost"
    failed = stored[exhausted.pk]
    assert (failed.status, failed.retry_count, failed.worker_id, failed.lease_id) == (
        JobStatus.FAILED,
        2,
        exhausted.worker_id,  # a failed job keeps the attempt that ran it
        exhausted.lease_id,
    )
    assert failed.last_error == "worker lost; retries exhausted (2 of 2 used)"
    assert failed.finished_at is not None and stored[retry.pk].finished_at is None
    outcomes = dict(JobAttempt.objects.filter(lease_id__in=leases.values()).values_list("lease_id", "outcome"))
    assert outcomes == {
        leases[unacked.pk]: AttemptOutcome.UNACKNOWLEDGED,
        leases[retry.pk]: AttemptOutcome.LOST,
        leases[exhausted.pk]: AttemptOutcome.LOST,
    }
    assert {j.pk: j.retry_count for j in jobs} == {unacked.pk: 3, retry.pk: 2, exhausted.pk: 2}  # instances as stored
    changed = {row.target_id: row.details for row in audit_rows(actions.JOB_STATUS_CHANGED)}
    assert {pk: (d["from"], d["to"], d["reason"]) for pk, d in changed.items()} == {
        unacked.pk: (JobStatus.DISPATCHED, JobStatus.QUEUED, "worker lost before acknowledging"),
        retry.pk: (JobStatus.RUNNING, JobStatus.QUEUED, "worker lost"),
        exhausted.pk: (JobStatus.RUNNING, JobStatus.FAILED, "worker lost; retries exhausted (2 of 2 used)"),
    }
    requeued = {row.target_id: row.details for row in audit_rows(actions.JOB_REQUEUED)}
    assert {pk: (d["retry_spent"], d["retry_count"]) for pk, d in requeued.items()} == {
        unacked.pk: (False, 3),
        retry.pk: (True, 2),
    }


def test_a_release_with_one_job_changed_meanwhile_is_refused_whole():
    unacked, retry, exhausted = _released_mix()
    jobs = list(Job.objects.filter(pk__in=[unacked.pk, retry.pk, exhausted.pk]))
    Job.objects.filter(pk=retry.pk).update(status=JobStatus.CANCELLED)  # another process, unguarded

    with pytest.raises(InvalidTransition), transaction.atomic():
        jobs_release(jobs=jobs, actor=ACTOR, reason="worker lost")

    assert dict(Job.objects.values_list("pk", "status")) == {
        unacked.pk: JobStatus.DISPATCHED,
        retry.pk: JobStatus.CANCELLED,
        exhausted.pk: JobStatus.RUNNING,
    }
    assert audit_rows() == []


def test_a_release_larger_than_one_statement_is_written_in_several(monkeypatch):
    monkeypatch.setattr(updates, "ROWS_PER_UPDATE", 2)
    held = [job_on_worker(WorkerFactory(), status=JobStatus.RUNNING, retry_count=n % 2, max_retries=1) for n in range(5)]
    jobs = list(Job.objects.filter(pk__in=[j.pk for j in held]))

    with CaptureQueriesContext(connection) as captured, transaction.atomic():
        released = jobs_release(jobs=jobs, actor=ACTOR, reason="worker lost")

    assert len(_statements(captured, 'UPDATE "queue_job" ')) == 3
    assert len(released.requeued) == 3 and len(released.failed) == 2
    assert dict(Job.objects.values_list("pk", "status")) == {
        j.pk: JobStatus.FAILED if j.retry_count else JobStatus.QUEUED for j in held
    }
