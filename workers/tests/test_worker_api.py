"""The agent's side of the protocol over HTTP: register, heartbeat, disconnect, queue (X-Worker-Token)."""

from datetime import timedelta

import pytest
from django.utils import timezone

from audit import actions
from audit.models import AuditEvent
from job_queue.models import AttemptOutcome, Job, JobAttempt, JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import Worker, WorkerStatus, WorkerType
from workers.tests.factories import WorkerFactory, worker_token
from workers.tests.support import audit_rows, sent_events

pytestmark = pytest.mark.django_db

REGISTER = "/api/workers/register"
HEARTBEAT = "/api/workers/heartbeat"
DISCONNECT = "/api/workers/disconnect"
QUEUE = "/api/workers/queue"

UPSTREAM_BODY = {
    "name": "gpu-worker-1",
    "gpu_info": {"name": "NVIDIA A100-SXM4-80GB", "vram_gb": 80.0, "count": 2, "driver": "12.4", "accelerator": "cuda"},
    "persistent": True,
    "current_job_id": None,
}


def _fresh(**kwargs):
    return WorkerFactory(fresh=True, **kwargs)


def _reload(obj):
    obj.refresh_from_db()
    return obj


# --- register -------------------------------------------------------------------------------------


def test_register_with_the_spec_flat_fields(worker_client):
    worker = _fresh()

    response = worker_client(worker).post(
        REGISTER,
        {
            "name": worker.name,
            "gpu_count": 2,
            "gpu_name": "NVIDIA H100 80GB HBM3",
            "gpu_vram_gb": 80,
            "accelerator_type": "cuda",
            "hostname": "node-7",
            "agent_version": "0.3.1",
        },
    )

    assert response.status_code == 200
    body = response.json()
    assert body["worker_id"] == worker.pk
    assert (body["status"], body["worker_type"], body["draining"]) == ("idle", "persistent", False)
    assert body["sse_url"] == f"http://testserver/api/workers/stream?worker_id={worker.pk}"
    assert body["heartbeat_interval"] == 30
    assert "resume_job" not in body and "abandon_job" not in body
    worker = _reload(worker)
    assert worker.status == WorkerStatus.IDLE
    assert (worker.gpu_count, worker.gpu_name, worker.gpu_vram_gb, worker.accelerator_type) == (
        2,
        "NVIDIA H100 80GB HBM3",
        80.0,
        "cuda",
    )
    assert (worker.hostname, worker.agent_version) == ("node-7", "0.3.1")
    assert worker.connected_at and worker.last_heartbeat
    (registered,) = audit_rows(actions.WORKER_REGISTERED, target_id=worker.pk)
    assert (registered.actor_type, registered.actor_id, registered.client_ip) == ("worker", worker.pk, "127.0.0.1")
    assert registered.details["gpu_count"] == 2 and registered.details["resumed"] is False
    (changed,) = audit_rows(actions.WORKER_STATUS_CHANGED, target_id=worker.pk)
    assert (changed.details["from"], changed.details["to"]) == ("connecting", "idle")


def test_register_with_the_upstream_gpu_info_object(worker_client):
    worker = _fresh()

    response = worker_client(worker).post(REGISTER, UPSTREAM_BODY)

    assert response.status_code == 200
    assert response.json()["worker_id"] == worker.pk
    worker = _reload(worker)
    assert (worker.gpu_count, worker.gpu_name, worker.gpu_vram_gb, worker.accelerator_type) == (
        2,
        "NVIDIA A100-SXM4-80GB",
        80.0,
        "cuda",
    )
    assert worker.gpu_info["driver"] == "12.4"


@pytest.mark.parametrize(
    ("gpu_info", "accelerator"),
    [
        ({"name": "Apple M2", "vram_gb": None, "count": 1, "accelerator": "mps"}, "mps"),
        ({"name": None, "vram_gb": None, "count": 0, "accelerator": None}, "cpu"),
        ({"name": "NVIDIA L4", "count": 1, "accelerator": None}, "cuda"),
    ],
)
def test_register_accelerator_defaults(worker_client, gpu_info, accelerator):
    worker = _fresh()

    assert worker_client(worker).post(REGISTER, {"gpu_info": gpu_info}).status_code == 200

    assert _reload(worker).accelerator_type == accelerator


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"gpu_info": {"count": "lots"}}, "invalid_capabilities"),
        ({"gpu_info": {"count": -1}}, "invalid_capabilities"),
        ({"gpu_info": {"vram_gb": "nan"}}, "invalid_capabilities"),
        ({"gpu_count": -1}, "invalid"),
        ({"gpu_info": "A100"}, "invalid"),
    ],
)
def test_register_with_bad_capabilities_is_400_and_writes_nothing(worker_client, body, code):
    worker = _fresh()

    response = worker_client(worker).post(REGISTER, body)

    assert response.status_code == 400
    assert response.json()["code"] == code
    assert response.json()["detail"]
    worker = _reload(worker)
    assert (worker.status, worker.gpu_count, worker.connected_at) == (WorkerStatus.CONNECTING, 0, None)
    assert audit_rows(actions.WORKER_REGISTERED) == []


def test_register_never_erases_admin_labels(worker_client):
    worker = _fresh(labels={"gpu_type": "a100", "location": "datacenter-a"})

    refused = worker_client(worker).post(REGISTER, {**UPSTREAM_BODY, "labels": {}})
    registered = worker_client(worker).post(REGISTER, UPSTREAM_BODY)

    assert refused.status_code == 400 and "labels" in refused.json()["errors"]  # labels are the operators' to set
    assert registered.status_code == 200
    assert _reload(worker).labels == {"gpu_type": "a100", "location": "datacenter-a"}


@pytest.mark.parametrize(
    ("worker_type", "agent_says_persistent"),
    [(WorkerType.PERSISTENT, False), (WorkerType.EPHEMERAL, True), (WorkerType.PERSISTENT, None)],
)
def test_register_never_changes_worker_type(worker_client, worker_type, agent_says_persistent):
    worker = _fresh(worker_type=worker_type)

    response = worker_client(worker).post(REGISTER, {**UPSTREAM_BODY, "persistent": agent_says_persistent})

    assert response.json()["worker_type"] == worker_type
    assert _reload(worker).worker_type == worker_type


@pytest.mark.parametrize("start", ["draining", "offline"])
def test_register_never_leaves_draining(worker_client, commit, start):
    """A drained worker (live or offline) comes back draining and is given nothing."""
    now = timezone.now()
    worker = (
        WorkerFactory(draining=True) if start == "draining" else WorkerFactory(offline=True, drain_requested_at=now)
    )
    JobFactory()

    with commit():
        response = worker_client(worker).post(REGISTER, UPSTREAM_BODY)

    assert (response.json()["status"], response.json()["draining"]) == ("draining", True)
    assert _reload(worker).status == WorkerStatus.DRAINING
    assert sent_events() == []


def test_register_of_an_idle_worker_with_an_open_stream_dispatches_a_queued_job(worker_client, commit):
    worker = WorkerFactory(offline=True, stream_id="s1")
    job = JobFactory()

    with commit():
        assert worker_client(worker).post(REGISTER, UPSTREAM_BODY).status_code == 200

    assert _reload(job).status == JobStatus.DISPATCHED
    assert [(e["type"], e["data"]["job_id"]) for e in sent_events(worker.pk)] == [("job_submit", job.pk)]


@pytest.mark.parametrize("job_status", [JobStatus.DISPATCHED, JobStatus.RUNNING])
def test_register_with_its_live_job_resumes_it(worker_client, commit, job_status):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=job_status)

    with commit():
        response = worker_client(worker).post(REGISTER, {**UPSTREAM_BODY, "current_job_id": job.pk})

    # Naming the job acknowledges its dispatch: a dispatched job is running from here on.
    body = response.json()
    assert body["resume_job"] == {"job_id": job.pk, "status": JobStatus.RUNNING, "attempt": job.lease_id, "attempt_number": 1}
    assert "abandon_job" not in body
    assert body["status"] == "busy"
    worker = _reload(worker)
    assert (worker.status, worker.current_job_id) == (WorkerStatus.BUSY, job.pk)
    stored = _reload(job)
    assert (stored.status, stored.lease_id, stored.retry_count) == (JobStatus.RUNNING, job.lease_id, 0)
    attempt = JobAttempt.objects.get(lease_id=job.lease_id)
    assert attempt.outcome == AttemptOutcome.PENDING
    if job_status == JobStatus.DISPATCHED:
        assert attempt.started_at is not None
    acks = [r.details for r in audit_rows(actions.JOB_STATUS_CHANGED, target_id=job.pk)]
    expected = [{"from": "dispatched", "to": "running", "reason": "re-registered naming the job", "attempt": 1, "worker": worker.pk}]
    assert acks == (expected if job_status == JobStatus.DISPATCHED else [])
    assert sent_events() == []
    assert audit_rows(actions.WORKER_REGISTERED)[0].details["resumed"] is True


def test_draining_worker_resuming_its_job_stays_draining(worker_client):
    worker = WorkerFactory(draining=True)
    job = job_on_worker(worker)

    body = worker_client(worker).post(REGISTER, {**UPSTREAM_BODY, "current_job_id": job.pk}).json()

    assert body["resume_job"]["job_id"] == job.pk
    assert body["status"] == "draining"
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.DRAINING, job.pk)


def _cancelled_on(worker):
    job = job_on_worker(worker)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.CANCELLED)
    return job


def _on_other_worker(worker):
    return job_on_worker(WorkerFactory())


def _requeued(worker):
    return JobFactory(status=JobStatus.QUEUED, attempt_count=1)


def _completed(worker):
    return JobFactory(status=JobStatus.COMPLETED, worker=worker)


@pytest.mark.parametrize(
    "make_job",
    [_cancelled_on, _on_other_worker, _requeued, _completed],
    ids=["cancelled", "reassigned", "requeued", "completed"],
)
def test_register_with_a_job_no_longer_its_own_is_told_to_abandon_it(worker_client, make_job):
    worker = WorkerFactory()
    job = make_job(worker)
    before = Job.objects.values().get(pk=job.pk)

    body = worker_client(worker).post(REGISTER, {**UPSTREAM_BODY, "current_job_id": job.pk}).json()

    assert body["abandon_job"] == job.pk
    assert "resume_job" not in body
    worker = _reload(worker)
    assert (worker.status, worker.current_job_id) == (WorkerStatus.IDLE, None)
    assert Job.objects.values().get(pk=job.pk) == before


def test_register_with_an_unknown_job_is_told_to_abandon_it(worker_client):
    worker = WorkerFactory()

    body = worker_client(worker).post(REGISTER, {**UPSTREAM_BODY, "current_job_id": "j_0000000000000000"}).json()

    assert body["abandon_job"] == "j_0000000000000000"
    assert body["status"] == "idle"


def test_register_without_an_unacknowledged_job_requeues_it_without_spending_a_retry(worker_client):
    worker = WorkerFactory(stream_id=None)
    job = job_on_worker(worker, status=JobStatus.DISPATCHED)

    body = worker_client(worker).post(REGISTER, UPSTREAM_BODY).json()

    assert "abandon_job" not in body and "resume_job" not in body
    job = _reload(job)
    assert (job.status, job.worker_id, job.lease_id, job.retry_count) == (JobStatus.QUEUED, None, None, 0)
    attempt = JobAttempt.objects.get(job=job)
    assert attempt.outcome == AttemptOutcome.UNACKNOWLEDGED and attempt.finished_at
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.IDLE, None)


def test_register_without_its_running_job_requeues_it_spending_a_retry(worker_client):
    worker = WorkerFactory(stream_id=None)
    job = job_on_worker(worker, status=JobStatus.RUNNING)
    other = JobFactory()

    body = worker_client(worker).post(REGISTER, {**UPSTREAM_BODY, "current_job_id": other.pk}).json()

    assert body["abandon_job"] == other.pk
    job = _reload(job)
    assert (job.status, job.retry_count) == (JobStatus.QUEUED, 1)
    assert JobAttempt.objects.get(job=job).outcome == AttemptOutcome.LOST
    (requeued,) = audit_rows(actions.JOB_REQUEUED, target_id=job.pk)
    assert requeued.details["retry_spent"] is True


def test_register_naming_another_worker_is_refused_and_audited(worker_client):
    worker = _fresh()
    other = WorkerFactory()

    response = worker_client(worker).post(REGISTER, {**UPSTREAM_BODY, "worker_id": other.pk}, REMOTE_ADDR="10.1.1.1")

    assert response.status_code == 403
    assert response.json()["code"] == "permission_denied"
    assert _reload(worker).status == WorkerStatus.CONNECTING
    assert audit_rows(actions.WORKER_REGISTERED) == []
    (failed,) = audit_rows(actions.WORKER_REGISTRATION_FAILED)
    assert (failed.success, failed.client_ip) == (False, "10.1.1.1")
    assert other.pk in failed.details["reason"]


@pytest.mark.parametrize("token", ["wt_bogus-token-value", "", None], ids=["unknown", "empty", "missing"])
def test_failed_registration_is_audited_with_client_ip(api_client, token):
    headers = {"REMOTE_ADDR": "10.9.8.7"}
    if token is not None:
        headers["HTTP_X_WORKER_TOKEN"] = token

    response = api_client.post(REGISTER, {"name": "intruder"}, **headers)

    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"
    assert response.json()["detail"]
    (failed,) = audit_rows(actions.AUTH_FAILED)
    assert (failed.success, failed.client_ip, failed.actor_type, failed.target_type) == (
        False,
        "10.9.8.7",
        "worker",
        "token",
    )
    assert failed.details["token_prefix"] == (token or "")[:10]
    assert failed.details["path"] == REGISTER
    assert failed.details["reason"]
    assert audit_rows(actions.WORKER_REGISTERED) == []


def test_registration_with_a_revoked_token_is_refused_and_audited(worker_client):
    worker = _fresh()
    plaintext = worker_token(worker)
    worker.tokens.update(revoked_at=timezone.now())

    response = worker_client(worker, token=plaintext).post(REGISTER, UPSTREAM_BODY, REMOTE_ADDR="192.0.2.1")

    assert response.status_code == 401
    (failed,) = audit_rows(actions.AUTH_FAILED)
    assert (failed.success, failed.client_ip) == (False, "192.0.2.1")
    assert failed.details["token_prefix"] == worker.tokens.get().prefix  # the revoked token, recognisable
    assert plaintext not in str(failed.details)
    assert _reload(worker).status == WorkerStatus.CONNECTING


def test_an_operator_token_cannot_register_a_worker(operator_client):
    response = operator_client.post(REGISTER, UPSTREAM_BODY)

    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"
    assert audit_rows(actions.WORKER_REGISTERED) == []
    assert audit_rows(actions.AUTH_FAILED)


# --- heartbeat ------------------------------------------------------------------------------------


def test_heartbeat_records_liveness_and_metrics(worker_client):
    long_ago = timezone.now() - timedelta(minutes=1)
    worker = WorkerFactory(last_heartbeat=long_ago)

    response = worker_client(worker).post(
        HEARTBEAT,
        {
            "worker_id": worker.pk,
            "status": "idle",
            "current_job_id": None,
            "gpu_utilization": [12.5],
            "cpu_percent": 3.0,
        },
    )

    assert response.status_code == 200
    assert response.json() == {"status": "idle", "draining": False, "current_job_id": None, "current_attempt": None}
    worker = _reload(worker)
    assert worker.last_heartbeat > long_ago
    assert worker.metrics == {"gpu_utilization": [12.5], "cpu_percent": 3.0}
    assert audit_rows(actions.WORKER_STATUS_CHANGED) == []


def test_heartbeat_keeps_a_draining_worker_draining(worker_client):
    worker = WorkerFactory(draining=True)

    response = worker_client(worker).post(HEARTBEAT, {"worker_id": worker.pk, "status": "idle", "current_job_id": None})

    assert response.json() == {"status": "draining", "draining": True, "current_job_id": None, "current_attempt": None}
    assert _reload(worker).status == WorkerStatus.DRAINING


def test_heartbeat_status_field_does_not_move_a_busy_worker(worker_client):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    response = worker_client(worker).post(HEARTBEAT, {"status": "idle", "current_job_id": None})

    assert response.json() == {"status": "busy", "draining": False, "current_job_id": job.pk, "current_attempt": None}
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.BUSY, job.pk)


def test_heartbeat_running_nothing_frees_a_worker_whose_job_was_cancelled(worker_client, operator_client, commit):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    operator_client.post(f"/api/queue/{job.pk}/cancel")
    following = JobFactory()

    with commit():
        response = worker_client(worker).post(HEARTBEAT, {"status": "idle", "current_job_id": None})

    assert response.status_code == 200
    assert _reload(job).status == JobStatus.CANCELLED
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.BUSY, following.pk)


def test_heartbeat_running_nothing_keeps_a_dispatch_not_yet_received(worker_client, commit):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.DISPATCHED)

    with commit():
        worker_client(worker).post(HEARTBEAT, {"status": "idle", "current_job_id": None})

    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.BUSY, job.pk)
    assert _reload(job).status == JobStatus.DISPATCHED


def test_offline_worker_that_heartbeats_comes_back_and_gets_work(worker_client, commit):
    worker = WorkerFactory(offline=True, stream_id="still-open")
    job = JobFactory()

    with commit():
        response = worker_client(worker).post(HEARTBEAT, {"status": "idle"})

    assert response.json()["status"] == "idle"
    changes = audit_rows(actions.WORKER_STATUS_CHANGED, target_id=worker.pk)
    assert [(c.details["from"], c.details["to"]) for c in changes] == [("offline", "idle"), ("idle", "busy")]
    assert changes[0].details["reason"] == "heartbeat after being offline"
    assert _reload(job).status == JobStatus.DISPATCHED
    assert [e["data"]["job_id"] for e in sent_events(worker.pk)] == [job.pk]


def test_offline_drained_worker_that_heartbeats_comes_back_draining(worker_client, commit):
    worker = WorkerFactory(offline=True, stream_id="open", drain_requested_at=timezone.now())
    JobFactory()

    with commit():
        response = worker_client(worker).post(HEARTBEAT, {"status": "idle"})

    assert response.json() == {"status": "draining", "draining": True, "current_job_id": None, "current_attempt": None}
    assert sent_events() == []


def test_heartbeat_naming_a_job_it_does_not_own_is_409_changes_nothing_and_is_audited(worker_client):
    long_ago = timezone.now() - timedelta(minutes=1)
    worker = WorkerFactory(last_heartbeat=long_ago, metrics={"cpu_percent": 1.0})
    foreign = job_on_worker(WorkerFactory(), progress={"step": 1})

    response = worker_client(worker).post(
        HEARTBEAT, {"status": "busy", "current_job_id": foreign.pk, "progress": {"step": 99}, "cpu_percent": 50.0}
    )

    assert response.status_code == 409
    body = response.json()
    assert (body["code"], body["abandon_job"]) == ("job_not_owned", foreign.pk)
    assert body["detail"]
    worker = _reload(worker)
    assert (worker.last_heartbeat, worker.metrics) == (long_ago, {"cpu_percent": 1.0})
    assert _reload(foreign).progress == {"step": 1}
    (refusal,) = AuditEvent.objects.filter(action="job.report_refused", target_id=foreign.pk)
    assert (refusal.success, refusal.actor_id, refusal.details["reported"], refusal.details["reason"]) == (
        False, worker.pk, "heartbeat", "job_not_owned"
    )


@pytest.mark.parametrize(
    ("progress", "stored"),
    [(0.25, {"fraction": 0.25}), (50, {"fraction": 0.5}), ({"step": 10, "total": 100}, {"step": 10, "total": 100})],
)
def test_heartbeat_progress_for_its_own_job_is_stored(worker_client, progress, stored):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    response = worker_client(worker).post(
        HEARTBEAT, {"status": "busy", "current_job_id": job.pk, "progress": progress, "log_tail": ["a", "b"]}
    )

    assert response.status_code == 200
    job = _reload(job)
    assert (job.progress, job.log_tail) == (stored, "a\nb")


def test_heartbeat_naming_another_worker_is_403(worker_client):
    worker = WorkerFactory()

    response = worker_client(worker).post(HEARTBEAT, {"worker_id": WorkerFactory().pk})

    assert response.status_code == 403
    assert response.json()["code"] == "permission_denied"


def test_heartbeat_without_a_token_is_401(api_client):
    response = api_client.post(HEARTBEAT, {"status": "idle"})

    assert response.status_code == 401
    assert set(response.json()) == {"code", "detail"}


# --- disconnect -----------------------------------------------------------------------------------


def test_disconnect_takes_an_idle_worker_offline(worker_client):
    worker = WorkerFactory()

    response = worker_client(worker).post(DISCONNECT, {"worker_id": worker.pk})

    assert response.json() == {"status": "offline"}
    assert _reload(worker).status == WorkerStatus.OFFLINE
    assert audit_rows(actions.WORKER_DISCONNECTED, target_id=worker.pk)
    assert worker_client(worker).post(DISCONNECT, {}).json() == {"status": "offline"}


def test_disconnect_requeues_an_unacknowledged_job_without_spending_a_retry(worker_client, commit):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.DISPATCHED)
    first_lease = job.lease_id
    other = WorkerFactory()

    with commit():
        worker_client(worker).post(DISCONNECT, {})

    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.OFFLINE, None)
    job = _reload(job)
    assert (job.retry_count, job.status, job.worker_id, job.attempt_count) == (0, JobStatus.DISPATCHED, other.pk, 2)
    attempts = list(JobAttempt.objects.filter(job=job).order_by("number"))
    assert [(a.number, a.worker_id, a.outcome) for a in attempts] == [
        (1, worker.pk, AttemptOutcome.UNACKNOWLEDGED),
        (2, other.pk, AttemptOutcome.PENDING),
    ]
    assert attempts[0].lease_id == first_lease != job.lease_id
    assert [(e["type"], e["data"]["attempt"]) for e in sent_events(other.pk)] == [("job_submit", job.lease_id)]
    assert sent_events(worker.pk) == []


def test_disconnect_requeues_a_running_job_spending_a_retry(worker_client):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING)

    worker_client(worker).post(DISCONNECT, {})

    job = _reload(job)
    assert (job.status, job.retry_count, job.worker_id, job.last_error) == (
        JobStatus.QUEUED,
        1,
        None,
        "agent disconnected",
    )
    assert JobAttempt.objects.get(job=job).outcome == AttemptOutcome.LOST


def test_disconnect_with_retries_exhausted_fails_the_job_with_the_reason(worker_client):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING, retry_count=3, max_retries=3, attempt_count=4)

    worker_client(worker).post(DISCONNECT, {})

    job = _reload(job)
    assert job.status == JobStatus.FAILED
    assert job.last_error == "agent disconnected; retries exhausted (3 of 3 used)"
    assert job.finished_at is not None
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.OFFLINE, None)


# --- queue (asked by an ephemeral agent after its job) ----------------------------------------------


def test_queue_says_no_jobs_when_none_fits(worker_client):
    worker = WorkerFactory(worker_type=WorkerType.EPHEMERAL, gpu_count=1)
    JobFactory(gpu_count=4)

    response = worker_client(worker).get(QUEUE, {"worker_id": worker.pk})

    assert response.json() == {"has_jobs": False}


def test_queue_says_yes_and_dispatches_to_an_idle_asker(worker_client, commit):
    worker = WorkerFactory(worker_type=WorkerType.EPHEMERAL)
    job = JobFactory()

    with commit():
        response = worker_client(worker).get(QUEUE)

    assert response.json() == {"has_jobs": True}
    assert [e["data"]["job_id"] for e in sent_events(worker.pk)] == [job.pk]


def test_queue_tells_a_draining_worker_there_is_nothing(worker_client):
    worker = WorkerFactory(draining=True)
    JobFactory()

    assert worker_client(worker).get(QUEUE).json() == {"has_jobs": False}
    assert _reload(worker).status == WorkerStatus.DRAINING
    assert Worker.objects.filter(status=WorkerStatus.BUSY).count() == 0
