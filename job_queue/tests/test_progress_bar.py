"""The jobs list's and the job page's progress: the bar, the trainer's ETA while it runs, and its stage."""

import pytest

from job_queue.models import JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.tests.factories import WorkerFactory
from workers.tests.support import admin_url, changelist_rows

pytestmark = pytest.mark.django_db

LIST = "/admin/queue/job/"

# A progress as the agent reports it from SimpleTuner's webhook events (worker_agent.webhooks).
RUNNING = {
    "step": 2, "total_steps": 6, "fraction": 1 / 3, "loss": 1.2789678573608398, "learning_rate": 0.0001, "epoch": 1,
    "eta_seconds": 95.4,
    "stage": {"key": "checkpoint_save", "label": "Saving Checkpoint", "status": "running", "message": "Saving checkpoint to /o/checkpoint-2"},
}  # fmt: skip


def test_a_running_job_shows_its_eta_and_stage_in_the_list_and_on_its_page(admin_client):
    job = job_on_worker(WorkerFactory(), status=JobStatus.RUNNING, progress=RUNNING)

    row = changelist_rows(admin_client.get(LIST))[job]
    assert 'aria-valuenow="33"' in row
    assert "33% · step 2/6 · loss 1.279 · ETA 1m35s" in row
    assert (
        '<span class="st-progress-stage st-muted" style="display: block" title="Saving checkpoint to /o/checkpoint-2">'
        "Saving Checkpoint: running</span>"
    ) in row

    page = admin_client.get(admin_url(job)).content.decode()
    assert "ETA 1m35s" in page and "Saving Checkpoint: running</span>" in page


def test_a_stage_before_any_step_is_shown_alone_with_its_own_count(admin_client):
    stage = {"key": "init_cache_text_embeds_status_update", "label": "Text Embedding Caching in Progress", "status": "running",
             "current": 2, "total": 6, "percent": 33.0}  # fmt: skip
    job = job_on_worker(WorkerFactory(), status=JobStatus.RUNNING, progress={"stage": stage})

    row = changelist_rows(admin_client.get(LIST))[job]
    assert "progressbar" not in row
    assert "Text Embedding Caching in Progress: running (2/6)</span>" in row


def test_a_finished_job_shows_no_eta_and_its_last_stage(admin_client):
    failed = JobFactory(status=JobStatus.FAILED, progress={**RUNNING, "stage": {"key": "training", "label": "Training", "status": "failed"}})
    done = JobFactory(status=JobStatus.COMPLETED, progress={"step": 6, "total_steps": 6, "eta_seconds": 0.0, "stage": "not an object"})

    rows = changelist_rows(admin_client.get(LIST))
    assert "ETA" not in rows[failed] and "Training: failed</span>" in rows[failed]
    assert 'st-progress-failed" role="progressbar" aria-valuenow="33"' in rows[failed]
    assert "ETA" not in rows[done] and "st-progress-stage" not in rows[done] and "100% · step 6/6" in rows[done]


def test_stage_text_from_a_trainer_is_escaped(admin_client):
    job = job_on_worker(WorkerFactory(), status=JobStatus.RUNNING, progress={"stage": {"label": "<script>x</script>", "status": "running"}})

    row = changelist_rows(admin_client.get(LIST))[job]
    assert "<script>x" not in row and "&lt;script&gt;x&lt;/script&gt;: running" in row
    job.progress = {"stage": {"label": "x", "message": '"><b>y'}}
    job.save()
    assert '<b>y' not in changelist_rows(admin_client.get(LIST))[job]
