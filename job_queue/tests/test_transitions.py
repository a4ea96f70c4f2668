"""jobs_transition enforces JOB_TRANSITIONS over every (from, to) pair, and audits each change."""

import itertools

import pytest

from audit import actions
from audit.services import Actor
from job_queue.models import JOB_TERMINAL, JOB_TRANSITIONS, Job, JobStatus
from job_queue.transitions import jobs_transition
from job_queue.tests.factories import JobFactory
from common.errors import InvalidTransition
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

ACTOR = Actor.system("test")
PAIRS = list(itertools.product(JobStatus.values, repeat=2))
ALLOWED = [(before, after) for before, after in PAIRS if before in JOB_TRANSITIONS[after]]
FORBIDDEN = [(before, after) for before, after in PAIRS if before not in JOB_TRANSITIONS[after]]


def test_table_names_every_status_and_never_leaves_a_terminal_one():
    assert set(JOB_TRANSITIONS) == set(JobStatus.values)
    for before, after in ALLOWED:
        assert before not in JOB_TERMINAL, f"{before} -> {after} reopens a finished job"
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
