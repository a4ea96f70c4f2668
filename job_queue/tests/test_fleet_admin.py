"""The Workers page's actions ask first: a confirmation page lists what will change, and nothing
changes until the operator says yes (issue 14.2 and 14.4)."""

import html
import re

import pytest
from django.utils import timezone

from audit import actions
from job_queue.models import Job, JobAttempt, AttemptOutcome, JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import Token, TokenKind, Worker, WorkerStatus
from workers.services import token_authenticate
from workers.tests.factories import WorkerFactory, worker_token
from workers.tests.support import admin_messages, admin_url, audit_rows, post_action

pytestmark = pytest.mark.django_db

LIST = "/admin/workers/worker/"


def confirmation(response):
    """Return (what changes, what is left as it is) as the confirmation page lists them, as plain text."""
    text = response.content.decode()
    assert 'id="confirm-form"' in text or 'id="confirm-refused"' in text, text[:2000]

    def items(list_id):
        match = re.search(rf'<ul class="[^"]*" id="{list_id}">(.*?)\n</ul>', text, re.S)
        return html.unescape(re.sub(r"<[^>]+>", " ", match.group(1))) if match else ""

    return " ".join(items("confirm-changes").split()), " ".join(items("confirm-refused").split())


def state():
    return (
        list(Worker.objects.order_by("pk").values_list("pk", "status", "drain_requested_at", "current_job_id")),
        list(Token.objects.order_by("pk").values_list("pk", "revoked_at")),
        list(Job.objects.order_by("pk").values_list("pk", "status", "retry_count")),
    )


def test_rotating_a_busy_worker_asks_first_naming_its_job_then_requeues_it_without_a_retry(admin_client, commit):
    worker = WorkerFactory(name="gpu-busy", status=WorkerStatus.BUSY)
    old = worker_token(worker)
    job = job_on_worker(worker, config_name="flux-lora", max_retries=0)
    before = state()

    asked = admin_client.post(admin_url(worker, "rotate"))

    assert asked.status_code == 200
    changes, _ = confirmation(asked)
    assert f"job {job.pk} (flux-lora, running) is stopped and goes back to the queue without spending a retry" in changes
    assert f"Yes, rotate its token and stop job {job.pk}" in asked.content.decode()
    assert state() == before  # asking changed nothing

    with commit():
        done = admin_client.post(admin_url(worker, "rotate"), {"post": "yes", "job": job.pk})

    assert done.status_code == 200 and 'id="worker-token"' in done.content.decode()
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=old) is None
    job.refresh_from_db()
    assert (job.status, job.retry_count) == (JobStatus.QUEUED, 0)
    assert JobAttempt.objects.get(job=job).outcome == AttemptOutcome.INTERRUPTED


def test_a_rotation_confirmed_for_an_idle_worker_is_refused_if_it_took_a_job_meanwhile(admin_client):
    worker = WorkerFactory(name="gpu-raced")
    worker_token(worker)
    changes, _ = confirmation(admin_client.post(admin_url(worker, "rotate")))
    assert "stopped" not in changes
    job = job_on_worker(worker)  # dispatched after the page was shown
    before = state()

    refused = admin_client.post(admin_url(worker, "rotate"), {"post": "yes", "job": ""})

    assert refused.status_code == 302
    (message,) = admin_messages(refused)
    assert message.startswith(f"Refused: worker gpu-raced is running job {job.pk}")
    assert state() == before
    assert audit_rows(actions.WORKER_TOKEN_ROTATED) == []


def test_the_drain_action_lists_what_changes_and_changes_nothing_until_confirmed(admin_client):
    idle = WorkerFactory(name="a-idle")
    busy = WorkerFactory(name="b-busy")
    job = job_on_worker(busy, config_name="sdxl")
    drained = WorkerFactory(name="c-drained", status=WorkerStatus.DRAINING)
    Worker.objects.filter(pk=drained.pk).update(drain_requested_at=busy.created_at)
    before = state()

    asked = post_action(admin_client, LIST, "drain_workers", [idle, busy, drained])

    changes, left = confirmation(asked)
    assert "a-idle" in changes and "status idle → draining" in changes and "it takes no new job" in changes
    assert f"it finishes its current job {job.pk} (sdxl), then takes no new one" in changes
    assert "c-drained" in left and "already draining" in left
    assert state() == before


def test_the_delete_action_lists_deletable_workers_and_why_the_others_stay(admin_client):
    gone = WorkerFactory(name="a-offline", offline=True)
    worker_token(gone)
    online = WorkerFactory(name="b-idle")
    before = state()

    asked = post_action(admin_client, LIST, "delete_workers", [gone, online])

    changes, left = confirmation(asked)
    assert "a-offline" in changes and "the worker and its 1 token(s) are deleted" in changes
    assert "b-idle" in left and "only an offline worker can be deleted" in left
    assert f'name="_selected_action" value="{gone.pk}"' in asked.content.decode()
    assert f'name="_selected_action" value="{online.pk}"' not in asked.content.decode()
    assert state() == before


def test_undrain_button_asks_then_puts_the_worker_back_in_service(admin_client, commit):
    worker = WorkerFactory(name="gpu-drained", status=WorkerStatus.DRAINING, drain_requested_at=timezone.now())
    page = admin_client.get(admin_url(worker)).content.decode()
    assert 'id="undrain-worker"' in page and 'id="drain-worker"' not in page
    before = state()

    changes, _ = confirmation(admin_client.post(admin_url(worker, "undrain")))
    assert "status draining → idle" in changes
    assert state() == before

    with commit():
        done = admin_client.post(admin_url(worker, "undrain"), {"post": "yes"})
    assert done.status_code == 302 and admin_messages(done) == ["Back in service: gpu-drained"]
    worker.refresh_from_db()
    assert (worker.status, worker.drain_requested_at) == (WorkerStatus.IDLE, None)
    assert len(audit_rows(actions.WORKER_UNDRAINED, target_id=worker.pk)) == 1


def test_edit_labels_shows_the_current_labels_then_saves_and_rematches(admin_client, commit):
    worker = WorkerFactory(name="gpu-labels", labels={"team": "nlp"})
    queued = JobFactory(worker_labels={"team": "vision"})

    form = admin_client.post(admin_url(worker, "labels")).content.decode()
    assert 'id="worker_labels_form"' in form and "team=nlp" in form
    bad = admin_client.post(admin_url(worker, "labels"), {"post": "yes", "labels": "no-equals-sign"})
    assert "expected KEY=VALUE" in bad.content.decode()
    assert Worker.objects.get(pk=worker.pk).labels == {"team": "nlp"}

    with commit():
        saved = admin_client.post(admin_url(worker, "labels"), {"post": "yes", "labels": "team=vision\ngpu=a100"})

    assert saved.status_code == 302
    assert admin_messages(saved) == ["Labels of gpu-labels: gpu=a100, team=vision. Queued jobs were matched again."]
    assert Worker.objects.get(pk=worker.pk).labels == {"team": "vision", "gpu": "a100"}
    queued.refresh_from_db()
    assert (queued.status, queued.worker_id) == (JobStatus.DISPATCHED, worker.pk)
    (row,) = audit_rows(actions.WORKER_LABELS_CHANGED)
    assert row.actor_name == "admin"


# --- jobs: cancel and retry ask first ------------------------------------------------------------------

JOBS = "/admin/queue/job/"


def test_cancel_lists_what_changes_for_each_job_and_changes_nothing_until_confirmed(admin_client, commit):
    worker = WorkerFactory(name="gpu-7", status=WorkerStatus.BUSY)
    running = job_on_worker(worker, config_name="flux")
    queued = JobFactory(config_name="sdxl")
    done = JobFactory(config_name="old", status=JobStatus.COMPLETED)
    before = state()

    asked = post_action(admin_client, JOBS, "cancel_jobs", [running, queued, done])

    changes, left = confirmation(asked)
    assert f"{running.pk} (flux) status running → cancelled worker gpu-7 is told to stop it" in changes
    assert f"{queued.pk} (sdxl) status queued → cancelled it leaves the queue" in changes
    assert f"{done.pk} (old) : already completed: nothing to cancel" in left
    assert state() == before

    button = admin_client.post(admin_url(queued, "cancel"))
    assert "status queued → cancelled" in confirmation(button)[0]
    assert state() == before
    with commit():
        admin_client.post(admin_url(queued, "cancel"), {"post": "yes"})
    assert Job.objects.get(pk=queued.pk).status == JobStatus.CANCELLED


def test_retry_lists_the_new_job_it_makes_and_what_it_refuses(admin_client):
    failed = JobFactory(config_name="broken", status=JobStatus.FAILED)
    running = JobFactory(config_name="busy", status=JobStatus.RUNNING)
    before = state()

    changes, left = confirmation(post_action(admin_client, JOBS, "retry_jobs", [failed, running]))

    assert f"a new job with the same settings is queued (retry_of {failed.pk})" in changes
    assert f"{running.pk} (busy) : running: only a failed or cancelled job can be retried" in left
    assert state() == before
    assert Job.objects.count() == 2
