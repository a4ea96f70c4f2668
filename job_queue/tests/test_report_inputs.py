"""Issue 12, findings 1 and 2 on the report path: whatever a trainer printed, a report is stored and the job ends.

A trainer's output (``log_tail``, ``error``, progress) is arbitrary bytes: NUL, unpaired surrogates,
NaN and numbers of any size are cleaned and kept, never refused and never a 500. An exit code is
bounded (a Windows one fits) and refused with a 400 naming ``exit_code`` only beyond its range; the
agent's minimal report (``protocol.minimal_report``) is always accepted. These ran into 500s on
PostgreSQL (NUL, integers over 2**31) and a stuck job on both databases (a NUL in a failure's reason).
"""

import json

import pytest

from job_queue.models import AttemptOutcome, JobStatus
from job_queue.tests.factories import job_on_worker
from job_queue.tests.test_worker_reports import status_url
from worker_agent import protocol
from workers.models import WorkerStatus
from workers.tests.factories import WorkerFactory

pytestmark = pytest.mark.django_db

NUL_LINE = "step 3 \x00loss\x00 0.5"
SURROGATE_LINE = "bad bytes \udcff\ud800 here"
WINDOWS_ACCESS_VIOLATION = 0xC0000005  # 3221225477: over PostgreSQL's integer


def _reload(obj):
    obj.refresh_from_db()
    return obj


@pytest.fixture
def post_raw(worker_client):
    """``post_raw(worker, path, text)``: POST ``text`` as the JSON body, byte for byte (NaN literals, escapes)."""

    def _post(worker, path, text):
        return worker_client(worker).post(path, data=text, content_type="application/json")

    return _post


def _json(body):
    # json.dumps writes "\u0000" and "\ud800" escapes and NaN literals, as Python agents (requests' json=) send them.
    return json.dumps(body)


# --- finding 1: NUL bytes and invalid text in trainer output --------------------------------------------


def test_progress_report_with_nul_and_surrogates_in_the_log_is_stored_and_later_reports_still_work(post_raw):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    running = post_raw(worker, status_url(job.pk), _json({"status": "running", "attempt": job.lease_id, "log_tail": [NUL_LINE, SURROGATE_LINE]}))

    assert running.status_code == 200, running.content
    log = _reload(job).log_tail
    assert log == "step 3 \ufffdloss\ufffd 0.5\nbad bytes \ufffd\ufffd here"
    completed = post_raw(worker, status_url(job.pk), _json({"status": "completed", "attempt": job.lease_id, "exit_code": 0, "log_tail": NUL_LINE}))
    assert completed.status_code == 200, completed.content
    job = _reload(job)
    assert (job.status, job.exit_code, job.log_tail) == (JobStatus.COMPLETED, 0, "step 3 \ufffdloss\ufffd 0.5")
    assert _reload(worker).status == WorkerStatus.IDLE


def test_failed_report_with_a_nul_in_its_reason_fails_the_job(post_raw):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    reason = "Training exited with code 3: RuntimeError: bad\x00byte \udc80"

    response = post_raw(worker, status_url(job.pk), _json({"status": "failed", "attempt": job.lease_id, "exit_code": 3, "error": reason}))

    assert response.status_code == 200, response.content
    job = _reload(job)
    assert (job.status, job.exit_code) == (JobStatus.FAILED, 3)
    assert job.last_error == "Training exited with code 3: RuntimeError: bad\ufffdbyte \ufffd"
    assert [(a.outcome, a.error) for a in job.attempts.all()] == [(AttemptOutcome.FAILED, job.last_error)]
    assert _reload(worker).status == WorkerStatus.IDLE


def test_an_overlong_reason_and_log_are_cut_not_refused(post_raw):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    response = post_raw(
        worker, status_url(job.pk), _json({"status": "failed", "attempt": job.lease_id, "error": "E" * 100_000, "log_tail": "L" * 100_000 + "end"})
    )

    assert response.status_code == 200, response.content
    job = _reload(job)
    assert (job.status, len(job.last_error)) == (JobStatus.FAILED, 4000)
    assert len(job.log_tail) == 16_000 and job.log_tail.endswith("Lend")


@pytest.mark.parametrize(
    ("progress", "stored"),
    [
        # NaN and Infinity literals, as Python's json module writes them
        ('{"step": 4, "loss": NaN, "learning_rate": Infinity, "epoch": -Infinity}', {"step": 4, "loss": None, "learning_rate": None, "epoch": None}),
        ('{"step": 1e400, "total_steps": 100}', {"step": None, "total_steps": 100}),  # overflows to infinity
        (f'{{"step": {10**30}, "total_steps": {2**63}}}', {"step": None, "total_steps": None}),  # beyond 64 bits
        (f'{{"step": {2**40}, "total_steps": {2**62}}}', {"step": 2**40, "total_steps": 2**62}),
        ('{"message": "nul\\u0000here", "metrics": {"acc\\u0000": 0.5, "x": "\\ud800"}}', {"message": "nul\ufffdhere", "metrics": {"acc\ufffd": 0.5, "x": "\ufffd"}}),
    ],
)
def test_progress_numbers_and_strings_never_fail_a_report(post_raw, progress, stored):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    response = post_raw(worker, status_url(job.pk), f'{{"status": "running", "attempt": "{job.lease_id}", "progress": {progress}}}')

    assert response.status_code == 200, response.content
    assert _reload(job).progress == stored


@pytest.mark.parametrize("progress", ["1e400", str(10**400), "NaN", "-5", '"half"', '[1, 2]', "true"])
def test_a_progress_that_is_not_an_object_or_a_fraction_is_ignored_not_refused(post_raw, progress):
    worker = WorkerFactory()
    job = job_on_worker(worker, progress={"step": 2})

    response = post_raw(worker, status_url(job.pk), f'{{"status": "completed", "attempt": "{job.lease_id}", "progress": {progress}}}')

    assert response.status_code == 200, response.content
    job = _reload(job)
    assert job.status == JobStatus.COMPLETED
    assert job.progress == {"step": 2, "fraction": 1.0}


def test_an_oversized_progress_keeps_its_top_level_numbers(post_raw):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    progress = {"step": 7, "loss": 0.25, "histogram": ["x" * 1000] * 200}

    response = post_raw(worker, status_url(job.pk), _json({"status": "running", "attempt": job.lease_id, "progress": progress}))

    assert response.status_code == 200, response.content
    assert _reload(job).progress == {"step": 7, "loss": 0.25}


def test_heartbeat_progress_and_log_with_nul_are_stored(worker_client):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    response = worker_client(worker).post(
        "/api/workers/heartbeat",
        {"status": "busy", "current_job_id": job.pk, "attempt": job.lease_id, "progress": {"step": 3, "message": "a\x00b"}, "log_tail": ["x\x00y"]},
    )

    assert response.status_code == 200, response.content
    job = _reload(job)
    assert (job.progress, job.log_tail) == ({"step": 3, "message": "a\ufffdb"}, "x\ufffdy")


# --- finding 2: exit codes and the agent's way out --------------------------------------------------------


@pytest.mark.parametrize("code", [WINDOWS_ACCESS_VIOLATION, -1073741819, 2**32 - 1, 255, -9])
def test_failed_report_with_a_real_exit_code_fails_the_job(worker_client, code):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    response = worker_client(worker).post(status_url(job.pk), {"status": "failed", "attempt": job.lease_id, "exit_code": code, "error": "crash"})

    assert response.status_code == 200, response.content
    job = _reload(job)
    assert (job.status, job.exit_code) == (JobStatus.FAILED, code)


@pytest.mark.parametrize("code", [2**32, 2**63, 10**30, -(2**31) - 1, "1e400", 1.5])
def test_exit_code_out_of_range_is_400_naming_it_and_the_minimal_report_then_fails_the_job(worker_client, post_raw, code):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    report = {"status": "failed", "attempt": job.lease_id, "exit_code": code, "error": "crash\x00", "log_tail": "x"}

    refused = post_raw(worker, status_url(job.pk), _json(report))

    assert refused.status_code == 400
    assert (refused.json()["code"], list(refused.json()["errors"])) == ("invalid", ["exit_code"])
    assert _reload(job).status == JobStatus.RUNNING
    minimal = protocol.minimal_report(report)
    assert "exit_code" not in minimal and "log_tail" not in minimal
    accepted = worker_client(worker).post(status_url(job.pk), minimal)
    assert accepted.status_code == 200, accepted.content
    job = _reload(job)
    assert (job.status, job.exit_code, job.last_error) == (JobStatus.FAILED, None, "crash\ufffd")


@pytest.mark.parametrize("status", [protocol.COMPLETED, protocol.FAILED, protocol.CANCELLED])
def test_the_minimal_form_of_any_result_is_accepted(worker_client, status):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    nasty = {
        "status": status,
        "attempt": job.lease_id,
        "exit_code": WINDOWS_ACCESS_VIOLATION,
        "error": "\x00\x1b[31m" + "\udcff" * 10_000,
        "progress": {"step": float("nan")},
        "log_tail": "\x00" * 10,
        "journal": True,
    }

    response = worker_client(worker).post(status_url(job.pk), protocol.minimal_report(nasty))

    assert response.status_code == 200, response.content
    assert _reload(job).status in (JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.QUEUED)  # cancelled by the worker: requeued
    assert _reload(worker).status == WorkerStatus.IDLE
