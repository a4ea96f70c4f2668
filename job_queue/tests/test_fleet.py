"""Operators' actions that end a worker's job: a rotation (refused while busy unless forced) and a drain
never spend one of the job's retries (issue 14.2)."""

from datetime import timedelta
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from audit import actions
from audit.services import Actor
from common.errors import Conflict, InvalidInput
from job_queue.agents import worker_disconnect
from job_queue.fleet import worker_rotate_token, worker_set_labels, worker_undrain
from job_queue.models import AttemptOutcome, Job, JobAttempt, JobStatus
from job_queue.sweeps import sweep_stale_workers
from job_queue.selectors import job_waiting_reason
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import Token, Worker, WorkerStatus
from workers.services import worker_drain
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

ACTOR = Actor.system("test")


def _reload(obj):
    obj.refresh_from_db()
    return obj


def test_rotating_a_busy_worker_is_refused_naming_its_job_and_changes_nothing():
    worker = WorkerFactory(status=WorkerStatus.BUSY)
    job = job_on_worker(worker, config_name="sdxl-lora")
    tokens_before = list(Token.objects.values_list("pk", "revoked_at"))

    with pytest.raises(Conflict) as refused:
        worker_rotate_token(worker_id=worker.pk, actor=ACTOR)

    assert refused.value.code == "worker_busy"
    assert job.pk in refused.value.detail and "sdxl-lora" in refused.value.detail and "force" in refused.value.detail
    assert refused.value.extra == {"job_id": job.pk}
    assert list(Token.objects.values_list("pk", "revoked_at")) == tokens_before
    assert (_reload(job).status, _reload(worker).status) == (JobStatus.RUNNING, WorkerStatus.BUSY)
    assert audit_rows(actions.WORKER_TOKEN_ROTATED) == []


def test_a_forced_rotation_requeues_the_job_without_spending_a_retry(commit):
    worker = WorkerFactory(status=WorkerStatus.BUSY)
    job = job_on_worker(worker, max_retries=1, retry_count=1)  # no retry left: still requeued

    with commit():
        plaintext, job_id = worker_rotate_token(worker_id=worker.pk, actor=ACTOR, force=True)

    assert job_id == job.pk and plaintext.startswith("wt_")
    job = _reload(job)
    assert (job.status, job.retry_count, job.worker_id) == (JobStatus.QUEUED, 1, None)
    assert "rotated" in job.last_error and "no retry spent" in job.last_error
    assert JobAttempt.objects.get(job=job).outcome == AttemptOutcome.INTERRUPTED
    worker = _reload(worker)
    assert (worker.status, worker.current_job_id) == (WorkerStatus.OFFLINE, None)
    (requeued,) = audit_rows(actions.JOB_REQUEUED)
    assert (requeued.details["retry_spent"], requeued.details["interrupted_by"]) == (False, "token rotation")
    assert len(audit_rows(actions.WORKER_TOKEN_ROTATED)) == 1


def test_rotating_an_idle_worker_needs_no_force(commit):
    worker = WorkerFactory()
    with commit():
        plaintext, job_id = worker_rotate_token(worker_id=worker.pk, actor=ACTOR)
    assert job_id is None and plaintext.startswith("wt_")
    assert _reload(worker).status == WorkerStatus.IDLE


def test_a_job_lost_while_its_worker_drains_spends_no_retry(commit):
    worker = WorkerFactory(status=WorkerStatus.BUSY)
    job = job_on_worker(worker, max_retries=0)
    with commit():
        worker_drain(worker_id=worker.pk, actor=ACTOR)
        worker_disconnect(worker_id=worker.pk, actor=ACTOR, reason="agent stopped")

    job = _reload(job)
    assert (job.status, job.retry_count) == (JobStatus.QUEUED, 0)
    assert f"drain of {worker.name}" in job.last_error
    (requeued,) = audit_rows(actions.JOB_REQUEUED)
    assert requeued.details["retry_spent"] is False


def test_the_health_sweep_spends_no_retry_for_a_draining_worker_but_does_for_others(commit):
    old = timezone.now() - timedelta(hours=1)
    drained = WorkerFactory(status=WorkerStatus.BUSY, last_heartbeat=old)
    lost = WorkerFactory(status=WorkerStatus.BUSY, last_heartbeat=old)
    on_drained = job_on_worker(drained, max_retries=3)
    on_lost = job_on_worker(lost, max_retries=3)
    Worker.objects.filter(pk=drained.pk).update(drain_requested_at=old, status=WorkerStatus.DRAINING)

    with commit():
        assert sweep_stale_workers()["requeued"] == 2

    assert Job.objects.get(pk=on_drained.pk).retry_count == 0
    assert Job.objects.get(pk=on_lost.pk).retry_count == 1
    outcomes = dict(JobAttempt.objects.values_list("job_id", "outcome"))
    assert outcomes == {on_drained.pk: AttemptOutcome.INTERRUPTED, on_lost.pk: AttemptOutcome.LOST}


# --- the API: POST /api/admin/workers/{id}/token ------------------------------------------------------


def test_the_api_refuses_to_rotate_a_busy_worker_with_409_naming_the_job(operator_client):
    worker = WorkerFactory(status=WorkerStatus.BUSY)
    job = job_on_worker(worker)

    response = operator_client.post(f"/api/admin/workers/{worker.pk}/token")

    assert response.status_code == 409
    body = response.json()
    assert (body["code"], body["job_id"]) == ("worker_busy", job.pk)
    assert job.pk in body["detail"]
    assert _reload(job).status == JobStatus.RUNNING


def test_the_api_rotates_a_busy_worker_with_force(operator_client, commit):
    worker = WorkerFactory(status=WorkerStatus.BUSY)
    job = job_on_worker(worker)

    with commit():
        response = operator_client.post(f"/api/admin/workers/{worker.pk}/token", {"force": True}, format="json")

    assert response.status_code == 200
    body = response.json()
    assert (body["worker_id"], body["requeued_job"]) == (worker.pk, job.pk)
    assert body["token"].startswith("wt_")
    assert (_reload(job).status, job.retry_count) == (JobStatus.QUEUED, 0)


def test_the_api_refuses_a_force_that_is_not_a_boolean(operator_client):
    worker = WorkerFactory(status=WorkerStatus.BUSY)
    job_on_worker(worker)
    response = operator_client.post(f"/api/admin/workers/{worker.pk}/token", {"force": "perhaps"}, format="json")
    assert response.status_code == 400
    assert response.json()["code"] == "invalid"


def test_manage_py_rotate_worker_token_refuses_a_busy_worker_unless_forced(commit):
    worker = WorkerFactory(status=WorkerStatus.BUSY, name="gpu-busy")
    job = job_on_worker(worker)

    with pytest.raises(CommandError, match=f"running job {job.pk}.*force"):
        call_command("rotate_worker_token", "gpu-busy", stdout=StringIO(), stderr=StringIO())
    assert _reload(job).status == JobStatus.RUNNING

    out, err = StringIO(), StringIO()
    with commit():
        call_command("rotate_worker_token", "gpu-busy", "--force", stdout=out, stderr=err)
    assert out.getvalue().strip().startswith("wt_")
    assert f"Job {job.pk} was taken back" in err.getvalue()
    assert (_reload(job).status, job.retry_count) == (JobStatus.QUEUED, 0)


# --- undrain and labels (issue 14.3) -----------------------------------------------------------------


def test_undrain_puts_an_idle_worker_back_in_service_and_offers_it_the_queue(commit):
    worker = WorkerFactory(labels={"team": "vision"})
    with commit():
        worker_drain(worker_id=worker.pk, actor=ACTOR)
    queued = JobFactory(worker_labels={"team": "vision"})
    assert _reload(queued).status == JobStatus.QUEUED

    with commit():
        worker_undrain(worker_id=worker.pk, actor=ACTOR)

    worker = _reload(worker)
    assert (worker.drain_requested_at, worker.current_job_id) == (None, queued.pk)
    assert (worker.status, _reload(queued).status) == (WorkerStatus.BUSY, JobStatus.DISPATCHED)
    (row,) = audit_rows(actions.WORKER_UNDRAINED)
    assert (row.target_id, row.details["status"]) == (worker.pk, WorkerStatus.DRAINING)


def test_undrain_of_a_busy_worker_keeps_its_job_and_of_an_undrained_one_changes_nothing(commit):
    worker = WorkerFactory(status=WorkerStatus.BUSY)
    job = job_on_worker(worker)
    with commit():
        worker_drain(worker_id=worker.pk, actor=ACTOR)
        worker_undrain(worker_id=worker.pk, actor=ACTOR)
        worker_undrain(worker_id=worker.pk, actor=ACTOR)
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.BUSY, job.pk)
    assert len(audit_rows(actions.WORKER_UNDRAINED)) == 1


def test_a_label_change_is_audited_and_rematches_queued_jobs(commit):
    worker = WorkerFactory(labels={"team": "nlp"})
    queued = JobFactory(worker_labels={"team": "vision"})
    assert "matches labels team=vision" in job_waiting_reason(queued)

    with commit():
        worker_set_labels(worker_id=worker.pk, labels={"team": "vision", "gpu": "a100"}, actor=ACTOR)

    assert _reload(worker).labels == {"team": "vision", "gpu": "a100"}
    assert (_reload(queued).status, queued.worker_id) == (JobStatus.DISPATCHED, worker.pk)
    (row,) = audit_rows(actions.WORKER_LABELS_CHANGED)
    assert row.details == {"from": {"team": "nlp"}, "to": {"team": "vision", "gpu": "a100"}}


def test_bad_labels_are_refused_and_change_nothing():
    worker = WorkerFactory(labels={"team": "nlp"})
    with pytest.raises(InvalidInput) as refused:
        worker_set_labels(worker_id=worker.pk, labels={".bad": "x"}, actor=ACTOR)
    assert refused.value.code == "invalid_labels"
    assert _reload(worker).labels == {"team": "nlp"}
    assert audit_rows(actions.WORKER_LABELS_CHANGED) == []


def test_the_api_undrains_and_edits_labels(operator_client, commit):
    worker = WorkerFactory(status=WorkerStatus.DRAINING, drain_requested_at=timezone.now())
    with commit():
        undrained = operator_client.post(f"/api/admin/workers/{worker.pk}/undrain")
    assert undrained.status_code == 200
    assert (undrained.json()["status"], undrained.json()["draining"]) == ("idle", False)

    with commit():
        relabelled = operator_client.put(f"/api/admin/workers/{worker.pk}/labels", {"labels": {"team": "x"}}, format="json")
    assert (relabelled.status_code, relabelled.json()["labels"]) == (200, {"team": "x"})

    refused = operator_client.put(f"/api/admin/workers/{worker.pk}/labels", {"labels": {"-no": "x"}}, format="json")
    assert (refused.status_code, refused.json()["code"]) == (400, "invalid_labels")
    missing = operator_client.put(f"/api/admin/workers/{worker.pk}/labels", {}, format="json")
    assert missing.status_code == 400
    assert operator_client.post("/api/admin/workers/w_000000000000/undrain").status_code == 404
