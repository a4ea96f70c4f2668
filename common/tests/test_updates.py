"""update_rows: one UPDATE writes each row's own values, guarded by what its writer read."""

import pytest
from django.db import connection
from django.db.models import F
from django.test.utils import CaptureQueriesContext

from common import updates
from common.updates import update_rows
from job_queue.models import Job, JobStatus
from job_queue.tests.factories import JobFactory
from workers.tests.factories import WorkerFactory

pytestmark = pytest.mark.django_db


def _updates(captured):
    return [q["sql"] for q in captured.captured_queries if q["sql"].startswith("UPDATE")]


def _stored(*jobs):
    return {
        j.pk: (j.status, j.retry_count, j.worker_id, j.progress, j.last_error)
        for j in Job.objects.filter(pk__in=[job.pk for job in jobs])
    }


def test_each_row_gets_its_own_values_and_keeps_the_fields_it_is_not_given():
    worker = WorkerFactory()
    a, b, c = (JobFactory(retry_count=1, last_error="old", progress={"fraction": 0.5}) for _ in range(3))

    with CaptureQueriesContext(connection) as captured:
        written = update_rows(
            Job.objects,
            {
                a.pk: {"status": JobStatus.FAILED, "retry_count": F("retry_count") + 1, "progress": {"fraction": 1.0}},
                b.pk: {"status": JobStatus.CANCELLED, "worker": worker, "last_error": "stopped"},
                c.pk: {"status": JobStatus.FAILED, "retry_count": F("retry_count") + 1, "progress": {"fraction": 1.0}},
            },
        )

    assert written == 3
    assert len(_updates(captured)) == 1
    assert _stored(a, b, c) == {
        a.pk: (JobStatus.FAILED, 2, None, {"fraction": 1.0}, "old"),
        b.pk: (JobStatus.CANCELLED, 1, worker.pk, {"fraction": 0.5}, "stopped"),
        c.pk: (JobStatus.FAILED, 2, None, {"fraction": 1.0}, "old"),
    }


def test_a_value_every_row_gets_is_set_plainly():
    a, b = JobFactory(), JobFactory()

    with CaptureQueriesContext(connection) as captured:
        update_rows(Job.objects, {a.pk: {"last_error": "x"}, b.pk: {"last_error": "x"}})

    (sql,) = _updates(captured)
    assert "CASE" not in sql
    assert _stored(a, b)[a.pk][4] == _stored(a, b)[b.pk][4] == "x"


def test_a_row_that_no_longer_holds_what_was_read_is_not_written():
    a, b = JobFactory(), JobFactory()
    Job.objects.filter(pk=b.pk).update(status=JobStatus.CANCELLED)  # moved by someone else since it was read

    written = update_rows(
        Job.objects,
        {a.pk: {"last_error": "a"}, b.pk: {"last_error": "b"}},
        expect={a.pk: {"status": JobStatus.QUEUED}, b.pk: {"status": JobStatus.QUEUED}},
    )

    assert written == 1
    assert {pk: row[4] for pk, row in _stored(a, b).items()} == {a.pk: "a", b.pk: ""}


def test_rows_beyond_one_statement_go_in_several(monkeypatch):
    monkeypatch.setattr(updates, "ROWS_PER_UPDATE", 2)
    jobs = [JobFactory() for _ in range(5)]

    with CaptureQueriesContext(connection) as captured:
        written = update_rows(Job.objects, {j.pk: {"last_error": f"e{n}"} for n, j in enumerate(jobs)})

    assert (written, len(_updates(captured))) == (5, 3)
    assert {pk: row[4] for pk, row in _stored(*jobs).items()} == {j.pk: f"e{n}" for n, j in enumerate(jobs)}


# --- one row: a request's own write -----------------------------------------------------------------


def _one_row(job, worker, *, status=JobStatus.QUEUED, error="x"):
    return update_rows(
        Job.objects,
        {job.pk: {"status": JobStatus.DISPATCHED, "worker": worker, "last_error": error, "progress": {"fraction": 0.25}}},
        expect={job.pk: {"status": status}},
    )


def test_one_row_is_written_with_its_values():
    worker = WorkerFactory()
    jobs = [JobFactory() for _ in range(3)]

    assert [_one_row(job, worker, error=f"e{n}") for n, job in enumerate(jobs)] == [1, 1, 1]

    assert {pk: row[:5] for pk, row in _stored(*jobs).items()} == {
        job.pk: (JobStatus.DISPATCHED, 0, worker.pk, {"fraction": 0.25}, f"e{n}") for n, job in enumerate(jobs)
    }


def test_one_row_that_no_longer_holds_what_was_read_is_not_written():
    job, worker = JobFactory(), WorkerFactory()
    Job.objects.filter(pk=job.pk).update(status=JobStatus.CANCELLED)

    assert _one_row(job, worker) == 0
    assert _stored(job)[job.pk][0] == JobStatus.CANCELLED


def test_null_and_expression_values_on_one_row():
    job, worker = JobFactory(retry_count=1), WorkerFactory()
    assert update_rows(Job.objects, {job.pk: {"worker": None, "last_error": "gone"}}) == 1
    assert update_rows(Job.objects, {job.pk: {"worker": worker, "last_error": "back"}}) == 1
    assert update_rows(Job.objects, {job.pk: {"retry_count": F("retry_count") + 1}}) == 1
    assert update_rows(Job.objects.filter(status=JobStatus.DISPATCHED), {job.pk: {"last_error": "f"}}) == 0

    assert _stored(job)[job.pk][1:5:2] == (2, {})
    assert _stored(job)[job.pk][2::2] == (worker.pk, "back")
