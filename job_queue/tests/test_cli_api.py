"""What the `simpletuner` command line needs from the queue API (issue 31): a log read from an offset, attempt by
attempt (`jobs logs --follow`); `?mine=true` (`jobs list --mine`); a job named on the change feed when its progress
or log moves (`jobs watch`)."""

import pytest

from job_queue.logs import attempt_append_log, attempt_log_chunk
from job_queue.models import Job
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.tests.factories import UserFactory, WorkerFactory

pytestmark = pytest.mark.django_db


def chunk(client, job, **params):
    return client.get(f"/api/queue/{job.pk}/log", params)


def test_a_log_is_read_from_an_offset_and_says_where_the_next_read_starts(operator_client):
    job = job_on_worker(WorkerFactory())
    attempt_append_log(lease_id=job.lease_id, chunk={"from": 0, "lines": ["one", "two"]})

    first = chunk(operator_client, job, attempt=1, offset=0)
    assert first.status_code == 200
    body = first.json()
    assert body == {
        "job_id": job.pk, "job_status": "running", "attempts": 1, "attempt": 1, "outcome": None,
        "offset": 0, "next_offset": 8, "skipped": 0, "text": "one\ntwo\n", "stopping": False,
    }  # fmt: skip
    attempt_append_log(lease_id=job.lease_id, chunk={"from": 2, "lines": ["three"]})
    after = chunk(operator_client, job, attempt=1, offset=body["next_offset"]).json()
    assert (after["text"], after["offset"], after["next_offset"]) == ("three\n", 8, 14)
    nothing = chunk(operator_client, job, attempt=1, offset=14).json()
    assert (nothing["text"], nothing["next_offset"]) == ("", 14)


def test_characters_cut_before_they_were_read_are_counted(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "JOB_LOG_MAX_CHARS": 12}
    job = job_on_worker(WorkerFactory())
    attempt_append_log(lease_id=job.lease_id, chunk={"from": 0, "lines": ["aaaa", "bbbb"]})
    seen = attempt_log_chunk(job, number=1, offset=0)
    attempt_append_log(lease_id=job.lease_id, chunk={"from": 2, "lines": ["cccc", "dddd"]})  # aaaa and bbbb go

    later = attempt_log_chunk(job, number=1, offset=seen["next_offset"])
    assert (seen["text"], later["text"], later["skipped"]) == ("aaaa\nbbbb\n", "cccc\ndddd\n", 0)
    late_reader = attempt_log_chunk(job, number=1, offset=0)
    assert (late_reader["skipped"], late_reader["offset"], late_reader["text"]) == (10, 10, "cccc\ndddd\n")


def test_a_log_read_refuses_what_it_cannot_answer(operator_client):
    job = job_on_worker(WorkerFactory())
    for params in ({"attempt": 0}, {"attempt": "x"}, {"attempt": 1, "offset": -1}, {"attempt": ""}):
        response = chunk(operator_client, job, **params)
        assert (response.status_code, response.json()["code"]) == (400, "invalid_filter"), params
    missing = chunk(operator_client, job, attempt=2)
    assert missing.status_code == 404 and "has no attempt 2" in missing.json()["detail"]
    assert operator_client.get("/api/queue/j_0000000000000000/log", {"attempt": 1}).status_code == 404


def test_mine_lists_only_my_jobs(bearer_client):
    me, other = UserFactory(groups=["operator"]), UserFactory()
    mine, theirs = JobFactory(submitted_by=me), JobFactory(submitted_by=other)
    client = bearer_client(me)

    assert {j["id"] for j in client.get("/api/queue/", {"mine": "true"}).json()["results"]} == {mine.pk}
    assert {j["id"] for j in client.get("/api/queue/", {"mine": "false"}).json()["results"]} == {mine.pk, theirs.pk}
    refused = client.get("/api/queue/", {"mine": "yes"})
    assert (refused.status_code, refused.json()["code"]) == (400, "invalid_filter")


def _names_job(events, job):
    return [e for e in events if {"type": "job", "id": job.pk} in e["targets"]]


def test_progress_and_log_name_the_job_on_the_change_feed(worker_client, commit, operator_changes):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    client = worker_client(worker)

    with commit():
        body = {"status": "running", "attempt": job.lease_id, "progress": {"step": 3, "total_steps": 10}}
        assert client.post(f"/api/workers/job/{job.pk}/status", body, format="json").status_code == 200
    assert _names_job(operator_changes, job)

    operator_changes.clear()
    with commit():
        lines = {"status": "running", "attempt": job.lease_id, "log_lines": {"from": 0, "lines": ["hi"]}}
        assert client.post(f"/api/workers/job/{job.pk}/status", lines, format="json").status_code == 200
    assert _names_job(operator_changes, job)

    operator_changes.clear()
    with commit():
        beat = {"worker_id": worker.pk, "status": "busy", "current_job_id": job.pk, "progress": {"step": 4}}
        assert client.post("/api/workers/heartbeat", beat, format="json").status_code == 200
    assert _names_job(operator_changes, job)
    assert Job.objects.get(pk=job.pk).progress["step"] == 4

    operator_changes.clear()
    with commit():
        plain = {"worker_id": worker.pk, "status": "busy", "current_job_id": job.pk}
        assert client.post("/api/workers/heartbeat", plain, format="json").status_code == 200
    assert not _names_job(operator_changes, job)  # a heartbeat that moves nothing says nothing


def test_a_cancelled_job_is_stopping_until_its_worker_confirms_and_the_confirmation_names_it(
    operator_client, worker_client, commit, operator_changes
):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    assert operator_client.post(f"/api/queue/{job.pk}/cancel", {}).status_code == 200
    assert chunk(operator_client, job, attempt=1).json()["stopping"] is True

    operator_changes.clear()
    with commit():
        stopped = {"status": "cancelled", "attempt": job.lease_id}
        assert worker_client(worker).post(f"/api/workers/job/{job.pk}/status", stopped, format="json").status_code == 200
    assert _names_job(operator_changes, job)
    assert chunk(operator_client, job, attempt=1).json()["stopping"] is False
