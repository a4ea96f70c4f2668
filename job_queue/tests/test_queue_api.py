"""Operators' queue API: submit, list, inspect, cancel (Authorization: Bearer sta_...)."""

import pytest

from audit import actions
from job_queue.models import AttemptOutcome, Job, JobAttempt, JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import WorkerStatus
from workers.tests.factories import UserFactory, WorkerFactory, worker_token
from workers.tests.support import audit_rows, sent_events

pytestmark = pytest.mark.django_db

SUBMIT = "/api/queue/submit"
LIST = "/api/queue/"


def _reload(obj):
    obj.refresh_from_db()
    return obj


# --- submit -----------------------------------------------------------------------------------------


def test_submit_dispatches_to_an_available_worker(queue_client, commit):
    worker = WorkerFactory(gpu_count=2, labels={"gpu_type": "a100"})

    with commit():
        response = queue_client.post(
            SUBMIT,
            {
                "config_name": "my-training-config",
                "config": {"model_type": "lora", "num_processes": 2},
                "dataloader": [{"id": "pics"}],
                "target": "worker",
                "worker_labels": {"gpu_type": "a100*"},
                "priority": 3,
            },
        )

    assert response.status_code == 201
    body = response.json()
    assert body["dispatched"] is True
    job = Job.objects.get()
    assert body["job_id"] == body["id"] == job.pk
    assert (body["status"], body["worker_id"], body["gpu_count"], body["priority"]) == ("dispatched", worker.pk, 2, 3)
    assert body["waiting_reason"] is None
    assert (job.status, job.worker_id, job.worker_labels) == (JobStatus.DISPATCHED, worker.pk, {"gpu_type": "a100*"})
    (event,) = sent_events(worker.pk)
    assert event["type"] == "job_submit"
    assert event["data"]["config"] == {"model_type": "lora", "num_processes": 2}
    assert event["data"]["dataloader"] == [{"id": "pics"}]
    assert isinstance(event["data"]["upload_endpoint"], str)
    assert audit_rows(actions.JOB_SUBMITTED, target_id=job.pk)


def test_submit_with_no_worker_queues_and_says_why(queue_client, commit):
    with commit():
        response = queue_client.post(SUBMIT, {"config_name": "my-config"})

    assert response.status_code == 201
    body = response.json()
    assert (body["dispatched"], body["status"]) == (False, "queued")
    assert body["waiting_reason"] == "no worker is registered"
    assert (body["target"], body["max_retries"], body["retry_on_failure"]) == ("worker", 3, False)


@pytest.mark.parametrize(
    ("config", "gpu_count", "expected"),
    [
        ({"num_processes": 4}, None, 4),
        ({"--num_processes": "2"}, None, 2),
        ({"num_processes": 4}, 1, 1),
        ({}, None, 0),
        ({"num_processes": ""}, None, 0),
    ],
)
def test_gpu_count_defaults_to_the_config_num_processes(queue_client, config, gpu_count, expected):
    body = {"config_name": "c", "config": config}
    if gpu_count is not None:
        body["gpu_count"] = gpu_count

    response = queue_client.post(SUBMIT, body)

    assert response.status_code == 201
    assert response.json()["gpu_count"] == expected
    assert Job.objects.get().gpu_count == expected


def test_job_needing_more_gpus_than_any_worker_waits_with_a_reason(queue_client):
    WorkerFactory(gpu_count=2)

    body = queue_client.post(SUBMIT, {"config_name": "big", "config": {"num_processes": 8}}).json()

    assert (body["dispatched"], body["status"]) == (False, "queued")
    assert body["waiting_reason"] == "no worker has >= 8 GPUs (the most any has is 2)"


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({}, "invalid"),
        ({"config_name": ""}, "invalid"),
        ({"config_name": "c", "target": "moon"}, "invalid"),
        ({"config_name": "c", "worker_labels": ["a100"]}, "invalid"),
        ({"config_name": "c", "config": "not-an-object"}, "invalid"),
        ({"config_name": "c", "dataloader": "pics"}, "invalid"),
        ({"config_name": "c", "gpu_count": -1}, "invalid"),
        ({"config_name": "c", "priority": 10_000}, "invalid"),
        ({"config_name": "c", "config": {"num_processes": "many"}}, "invalid_config"),
        ({"config_name": "c", "config": {"num_processes": -2}}, "invalid_config"),
    ],
)
def test_bad_submission_is_400_json_and_creates_nothing(queue_client, body, code):
    WorkerFactory()

    response = queue_client.post(SUBMIT, body)

    assert response.status_code == 400
    assert response.json()["code"] == code
    assert response.json()["detail"]
    assert Job.objects.count() == 0
    assert audit_rows() == []
    assert sent_events() == []


def test_submit_without_credentials_is_401(api_client):
    response = api_client.post(SUBMIT, {"config_name": "c"})

    assert response.status_code == 401
    assert set(response.json()) == {"code", "detail"}
    assert response.json()["code"] == "not_authenticated"
    assert Job.objects.count() == 0


def test_a_worker_token_cannot_submit_jobs(api_client):
    api_client.credentials(HTTP_X_WORKER_TOKEN=worker_token(WorkerFactory()))

    assert api_client.post(SUBMIT, {"config_name": "c"}).status_code == 401
    assert Job.objects.count() == 0


def test_an_invalid_bearer_token_is_401(api_client):
    api_client.credentials(HTTP_AUTHORIZATION="Bearer sta_not-a-token")

    response = api_client.post(SUBMIT, {"config_name": "c"})

    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"


# --- permissions: one per action ---------------------------------------------------------------------

ACTIONS = {  # what each endpoint needs, and a request it would otherwise accept
    "queue.submit_job": lambda client, job, failed: client.post(SUBMIT, {"config_name": "c"}),
    "queue.cancel_job": lambda client, job, failed: client.post(f"/api/queue/{job.pk}/cancel"),
    "queue.retry_job": lambda client, job, failed: client.post(f"/api/queue/{failed.pk}/retry"),
    "queue.view_job": lambda client, job, failed: client.get(f"/api/queue/{job.pk}"),
}


def _jobs_state():
    return sorted(Job.objects.values_list("pk", "status", "retry_of_id"))


def _session_client(client, user):
    """A session signed in through the browsable API's login page, as any user (staff or not) can."""
    user.set_password("pw-for-the-test")
    user.save()
    response = client.post("/api-auth/login/", {"username": user.username, "password": "pw-for-the-test"})
    assert response.status_code == 302
    return client


@pytest.mark.parametrize("needed", sorted(ACTIONS))
@pytest.mark.parametrize("who", ["no-permission", "view-only", "staff", "every-other-permission", "session-no-staff"])
def test_each_queue_action_needs_its_own_permission(bearer_client, client, needed, who):
    others = [p for p in ["queue.view_job", *ACTIONS, "workers.view_worker", "audit.view_auditevent"] if p != needed]
    user = {
        "no-permission": lambda: UserFactory(),
        "view-only": lambda: UserFactory(permissions=[] if needed == "queue.view_job" else ["queue.view_job"]),
        "staff": lambda: UserFactory(is_staff=True),
        "every-other-permission": lambda: UserFactory(is_staff=True, permissions=sorted(set(others))),
        "session-no-staff": lambda: UserFactory(),
    }[who]()
    caller = _session_client(client, user) if who == "session-no-staff" else bearer_client(user)
    job, failed = JobFactory(), JobFactory(status=JobStatus.FAILED)
    before = _jobs_state()

    response = ACTIONS[needed](caller, job, failed)

    assert response.status_code == 403
    assert response.json() == {"code": "permission_denied", "detail": f"You need the {needed} permission"}
    assert _jobs_state() == before
    assert audit_rows() == []
    assert sent_events() == []


@pytest.mark.parametrize("needed", sorted(ACTIONS))
def test_the_one_permission_is_enough(bearer_client, needed):
    caller = bearer_client(UserFactory(permissions=[needed]))
    job, failed = JobFactory(), JobFactory(status=JobStatus.FAILED)

    response = ACTIONS[needed](caller, job, failed)

    assert response.status_code in (200, 201)


# --- list and detail --------------------------------------------------------------------------------


def test_list_filters_by_status(queue_client):
    queued = JobFactory()
    running = job_on_worker(WorkerFactory())
    JobFactory(status=JobStatus.COMPLETED)

    def ids(query):
        response = queue_client.get(LIST, query)
        assert response.status_code == 200
        return {job["id"] for job in response.json()["results"]}

    assert ids({"status": "queued"}) == {queued.pk}
    assert ids({"status": "queued,running"}) == {queued.pk, running.pk}
    assert len(ids({})) == 3


def test_list_with_an_unknown_status_is_400(queue_client):
    response = queue_client.get(LIST, {"status": "queued,exploded"})

    assert response.status_code == 400
    assert response.json()["code"] == "invalid_filter"


def test_detail_shows_attempts_and_waiting_reason(queue_client):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    body = queue_client.get(f"/api/queue/{job.pk}").json()

    assert (body["id"], body["status"], body["worker_id"], body["waiting_reason"]) == (
        job.pk,
        "running",
        worker.pk,
        None,
    )
    assert [(a["number"], a["lease_id"], a["worker_id"]) for a in body["attempts"]] == [(1, job.lease_id, worker.pk)]
    assert queue_client.get("/api/queue/j_0000000000000000").json()["code"] == "not_found"


# --- cancel -----------------------------------------------------------------------------------------


def test_cancel_a_queued_job(queue_client, commit):
    job = JobFactory()

    with commit():
        response = queue_client.post(f"/api/queue/{job.pk}/cancel")

    assert response.status_code == 200
    assert response.json()["status"] == "cancelled"
    job = _reload(job)
    assert (job.status, job.finished_at is not None) == (JobStatus.CANCELLED, True)
    assert sent_events() == []
    (requested,) = audit_rows(actions.JOB_CANCEL_REQUESTED, target_id=job.pk)
    assert requested.details["status"] == "queued"


@pytest.mark.parametrize("status", [JobStatus.DISPATCHED, JobStatus.RUNNING])
def test_cancel_an_active_job_tells_its_worker_and_keeps_the_worker_busy(queue_client, commit, status):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=status)

    with commit():
        response = queue_client.post(f"/api/queue/{job.pk}/cancel")

    assert response.status_code == 200
    assert _reload(job).status == JobStatus.CANCELLED
    assert JobAttempt.objects.get(job=job).outcome == AttemptOutcome.CANCELLED
    assert sent_events(worker.pk) == [
        {
            "channel": f"worker-{worker.pk}",
            "type": "job_cancel",
            "data": {"type": "job_cancel", "job_id": job.pk, "attempt": job.lease_id},
        }
    ]
    # Freed only when the agent reports that the process has stopped.
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.BUSY, job.pk)


@pytest.mark.parametrize("status", [JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED])
def test_cancel_a_finished_job_is_409(queue_client, status):
    job = JobFactory(status=status)

    response = queue_client.post(f"/api/queue/{job.pk}/cancel")

    assert response.status_code == 409
    assert response.json()["code"] == "job_finished"
    assert _reload(job).status == status
    assert audit_rows() == []


def test_cancel_an_unknown_job_is_404(queue_client):
    response = queue_client.post("/api/queue/j_0000000000000000/cancel")

    assert response.status_code == 404
    assert response.json()["code"] == "not_found"


# --- retry ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("status", [JobStatus.FAILED, JobStatus.CANCELLED])
def test_retry_submits_a_new_job_with_the_same_settings_and_dispatches_it(queue_client, commit, status):
    original = JobFactory(
        status=status,
        config_name="sdxl-lora",
        config={"lr": 0.0001},
        dataloader=[{"id": "pics"}],
        worker_labels={"gpu": "a100*"},
        gpu_count=2,
        priority=7,
        max_retries=5,
        retry_on_failure=True,
        retry_count=5,
        attempt_count=6,
        last_error="CUDA out of memory",
    )
    worker = WorkerFactory(status=WorkerStatus.IDLE, stream_id="s1", gpu_count=4, labels={"gpu": "a100-80g"})

    with commit():
        response = queue_client.post(f"/api/queue/{original.pk}/retry")

    assert response.status_code == 201
    body = response.json()
    assert body["job_id"] != original.pk
    assert (body["retry_of"], body["dispatched"], body["status"]) == (original.pk, True, "dispatched")
    new = Job.objects.get(pk=body["job_id"])
    settings_of = lambda j: (  # noqa: E731
        j.config_name, j.config, j.dataloader, j.target, j.worker_labels, j.gpu_count, j.priority,
        j.max_retries, j.retry_on_failure,
    )  # fmt: skip
    assert settings_of(new) == settings_of(original)
    assert (new.retry_count, new.attempt_count, new.worker_id) == (0, 1, worker.pk)
    # The finished job is history: unchanged, with a row saying who retried it as what.
    assert _reload(original).status == status
    (retried,) = audit_rows(actions.JOB_RETRIED, target_id=original.pk)
    assert retried.details == {"status": status, "new_job": new.pk}
    (submitted,) = audit_rows(actions.JOB_SUBMITTED, target_id=new.pk)
    assert submitted.details["retry_of"] == original.pk
    assert [e["data"]["job_id"] for e in sent_events(worker.pk)] == [new.pk]


@pytest.mark.parametrize("status", [JobStatus.QUEUED, JobStatus.DISPATCHED, JobStatus.RUNNING, JobStatus.COMPLETED])
def test_retry_of_a_job_that_did_not_fail_is_409_and_creates_nothing(queue_client, status):
    job = JobFactory(status=status)

    response = queue_client.post(f"/api/queue/{job.pk}/retry")

    assert response.status_code == 409
    assert response.json() == {
        "code": "job_not_retryable",
        "detail": f"job {job.pk} is {status}; only failed or cancelled jobs can be retried",
    }
    assert list(Job.objects.values_list("pk", flat=True)) == [job.pk]
    assert audit_rows() == []


def test_retry_of_an_unknown_job_is_404(queue_client):
    response = queue_client.post("/api/queue/j_0000000000000000/retry")

    assert (response.status_code, response.json()["code"]) == (404, "not_found")


def test_retry_of_a_cancelled_job_its_worker_is_still_stopping_is_409(queue_client):
    worker = WorkerFactory(name="gpu-stopping")
    job = job_on_worker(worker)
    Job.objects.filter(pk=job.pk).update(status=JobStatus.CANCELLED)  # cancel sent; the agent has not confirmed

    response = queue_client.post(f"/api/queue/{job.pk}/retry")

    assert (response.status_code, response.json()["code"]) == (409, "job_still_stopping")
    assert "still stopping on worker gpu-stopping" in response.json()["detail"]
    assert Job.objects.count() == 1


def test_a_second_retry_while_the_first_is_unfinished_is_409(queue_client, commit):
    original = JobFactory(status=JobStatus.FAILED)
    with commit():
        first = queue_client.post(f"/api/queue/{original.pk}/retry").json()["job_id"]

    response = queue_client.post(f"/api/queue/{original.pk}/retry")

    assert (response.status_code, response.json()["code"]) == (409, "job_already_retried")
    assert response.json()["detail"] == f"job {original.pk} was already retried as {first}, which is queued"
    Job.objects.filter(pk=first).update(status=JobStatus.FAILED)
    assert queue_client.post(f"/api/queue/{original.pk}/retry").status_code == 201  # once that one failed too
