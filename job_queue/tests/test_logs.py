"""A job's whole log (issue 14.6): each line kept once, lost lines said, bounded per attempt with the cut
stated, read back from the API and the admin."""

import pytest

from job_queue.logs import attempt_append_log, job_full_log
from job_queue.models import JobAttempt, JobStatus
from job_queue.tests.factories import job_on_worker
from workers.tests.factories import WorkerFactory
from workers.tests.support import admin_url

pytestmark = pytest.mark.django_db


def _attempt(job):
    return JobAttempt.objects.get(lease_id=job.lease_id)


def test_lines_are_kept_once_and_lost_ones_are_said():
    job = job_on_worker(WorkerFactory(name="gpu-1"), config_name="sdxl")
    attempt_append_log(lease_id=job.lease_id, chunk={"from": 0, "lines": ["a", "b"]})
    attempt_append_log(lease_id=job.lease_id, chunk={"from": 1, "lines": ["b", "c"]})  # sent again, overlapping
    attempt_append_log(lease_id=job.lease_id, chunk={"from": 5, "lines": ["f"]})  # 3..4 never arrived

    attempt = _attempt(job)
    assert attempt.log == "a\nb\nc\n[… 2 line(s) of output never reached the orchestrator …]\nf\n"
    assert (attempt.log_lines, attempt.log_missing_lines) == (6, 2)
    text = job_full_log(job)
    assert f"# job {job.pk} (sdxl), running" in text
    assert "# --- attempt 1 on gpu-1 (in progress): 6 line(s) ---" in text
    assert "# [2 line(s) never reached the orchestrator]" in text


def test_each_attempt_keeps_its_last_characters_and_says_how_many_went(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "JOB_LOG_MAX_CHARS": 20}
    job = job_on_worker(WorkerFactory())
    attempt_append_log(lease_id=job.lease_id, chunk={"from": 0, "lines": ["line-one", "line-two", "line-three"]})

    attempt = _attempt(job)
    assert attempt.log == "line-two\nline-three\n"  # whole lines only
    assert attempt.log_dropped_chars == len("line-one\n")
    assert "# [the first 9 characters of this attempt's output were dropped: each attempt keeps its last 20" in job_full_log(job)


def test_a_report_carries_its_lines_into_the_log(worker_client, commit):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    client = worker_client(worker)
    body = {"status": "running", "attempt": job.lease_id, "log_lines": {"from": 0, "lines": ["hello\x00", 7]}}
    assert client.post(f"/api/workers/job/{job.pk}/status", body, format="json").status_code == 200
    done = {"status": "completed", "attempt": job.lease_id, "log_lines": {"from": 2, "lines": ["bye"]}}
    assert client.post(f"/api/workers/job/{job.pk}/status", done, format="json").status_code == 200
    malformed = {"status": "completed", "attempt": job.lease_id, "log_lines": {"from": "x", "lines": "nope"}}
    assert client.post(f"/api/workers/job/{job.pk}/status", malformed, format="json").status_code == 200
    assert _attempt(job).log == "hello\ufffd\n7\nbye\n"


def test_the_api_downloads_the_whole_log(operator_client):
    job = job_on_worker(WorkerFactory())
    attempt_append_log(lease_id=job.lease_id, chunk={"from": 0, "lines": ["epoch 1", "epoch 2"]})
    response = operator_client.get(f"/api/queue/{job.pk}/log")
    assert response.status_code == 200
    assert response["Content-Type"] == "text/plain; charset=utf-8"
    assert response["Content-Disposition"] == f'attachment; filename="{job.pk}.log"'
    assert "epoch 1\nepoch 2\n" in response.content.decode()
    missing = operator_client.get("/api/queue/j_0000000000000000/log")
    assert (missing.status_code, missing.json()["code"]) == (404, "not_found")


def test_the_admin_shows_the_whole_log_live_and_downloads_it(admin_client):
    job = job_on_worker(WorkerFactory())
    attempt_append_log(lease_id=job.lease_id, chunk={"from": 0, "lines": ["<b>not html</b>"]})
    page = admin_client.get(admin_url(job)).content.decode()
    assert 'id="full-log-link"' in page
    full = admin_client.get(admin_url(job, "log")).content.decode()
    assert "&lt;b&gt;not html&lt;/b&gt;" in full and "following the job" in full
    raw = admin_client.get(admin_url(job, "log"), {"raw": 1})
    assert raw["X-Job-Finished"] == "0" and "<b>not html</b>" in raw.content.decode()
    download = admin_client.get(admin_url(job, "log"), {"download": 1})
    assert download["Content-Disposition"] == f'attachment; filename="{job.pk}.log"'
    JobAttempt.objects.filter(job=job).update(outcome="completed")
    type(job).objects.filter(pk=job.pk).update(status=JobStatus.COMPLETED)
    assert "following the job" not in admin_client.get(admin_url(job, "log")).content.decode()


# --- the progress chart (issue 14.10) -------------------------------------------------------------------


def test_reports_and_heartbeats_build_the_attempts_progress_series_and_the_page_draws_it(worker_client, admin_client, commit):
    from job_queue.progress_history import MAX_SAMPLES, attempt_record_progress

    worker = WorkerFactory()
    job = job_on_worker(worker)
    client = worker_client(worker)
    for step, loss in ((10, 0.9), (20, 0.5)):
        body = {"status": "running", "attempt": job.lease_id, "progress": {"step": step, "total_steps": 100, "loss": loss}}
        assert client.post(f"/api/workers/job/{job.pk}/status", body, format="json").status_code == 200
    beat = {"worker_id": worker.pk, "status": "busy", "current_job_id": job.pk, "progress": {"step": 30, "loss": 0.25}}
    assert client.post("/api/workers/heartbeat", beat, format="json").status_code == 200
    client.post("/api/workers/heartbeat", beat, format="json")  # the same progress again: one sample

    samples = _attempt(job).progress_samples
    assert [s[1:] for s in samples] == [[10, 0.9], [20, 0.5], [30, 0.25]]
    page = admin_client.get(admin_url(job)).content.decode()
    assert 'id="progress-chart"' in page and 'class="st-chart-step"' in page and 'class="st-chart-loss"' in page

    for step in range(31, 31 + MAX_SAMPLES):
        attempt_record_progress(lease_id=job.lease_id, progress={"step": step})
    samples = _attempt(job).progress_samples
    assert len(samples) <= MAX_SAMPLES and samples[0][1] == 10 and samples[-1][1] == 30 + MAX_SAMPLES
