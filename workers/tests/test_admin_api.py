"""Operators' worker administration: /api/admin/workers (one permission per action, workers.permissions)."""

import hashlib

import pytest

from audit import actions
from job_queue.models import Job, JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import Token, TokenKind, Worker, WorkerStatus, WorkerType
from workers.services import token_authenticate
from workers.tests.factories import UserFactory, WorkerFactory, api_token, worker_token
from workers.tests.support import WORKER_MANAGER_PERMISSIONS, audit_rows, sent_events

pytestmark = pytest.mark.django_db

WORKERS = "/api/admin/workers"


def _reload(obj):
    obj.refresh_from_db()
    return obj


# --- permissions ------------------------------------------------------------------------------------

ENDPOINTS = [
    ("get", WORKERS),
    ("post", WORKERS),
    ("get", f"{WORKERS}/w_000000000000"),
    ("delete", f"{WORKERS}/w_000000000000"),
    ("post", f"{WORKERS}/w_000000000000/drain"),
    ("post", f"{WORKERS}/w_000000000000/token"),
]


@pytest.mark.parametrize(("method", "url"), ENDPOINTS)
def test_no_credentials_is_401_json(api_client, method, url):
    response = getattr(api_client, method)(url)

    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"
    assert set(response.json()) == {"code", "detail"}


@pytest.mark.parametrize(("method", "url"), ENDPOINTS)
def test_an_operator_without_the_permissions_gets_403(user_client, method, url):
    response = getattr(user_client, method)(url, {"name": "sneaky"})

    assert response.status_code == 403
    assert response.json()["code"] == "permission_denied"
    assert Worker.objects.count() == 0


@pytest.mark.parametrize("header", ["Bearer ", "Bearer sta_not-a-real-token", "Bearer wt_a-worker-style-token"])
def test_a_bad_bearer_header_is_401_json(api_client, header):
    api_client.credentials(HTTP_AUTHORIZATION=header)

    response = api_client.get(WORKERS)

    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"
    assert response["WWW-Authenticate"] == "Bearer"


def test_a_worker_token_is_not_an_operator_credential(api_client):
    api_client.credentials(HTTP_X_WORKER_TOKEN=worker_token(WorkerFactory()))

    assert api_client.get(WORKERS).status_code == 401


def test_a_revoked_operator_token_is_401(api_client, operator):
    plaintext = api_token(operator)
    operator.api_tokens.update(revoked_at="2024-01-01T00:00:00Z")
    api_client.credentials(HTTP_AUTHORIZATION=f"Bearer {plaintext}")

    assert api_client.get(WORKERS).status_code == 401


def test_an_inactive_user_token_is_401(bearer_client):
    user = UserFactory(permissions=list(WORKER_MANAGER_PERMISSIONS))
    client = bearer_client(user)
    user.is_active = False
    user.save()

    assert client.get(WORKERS).status_code == 401


def test_a_superuser_may_manage_workers(bearer_client):
    client = bearer_client(UserFactory(is_superuser=True))

    assert client.get(WORKERS).status_code == 200


PER_ACTION = [  # (permission, method, path): each endpoint's one permission
    ("workers.view_worker", "get", WORKERS),
    ("workers.add_worker", "post", WORKERS),
    ("workers.view_worker", "get", "{worker}"),
    ("workers.delete_worker", "delete", "{worker}"),
    ("workers.drain_worker", "post", "{worker}/drain"),
    ("workers.rotate_worker_token", "post", "{worker}/token"),
]


def _fleet_state():
    return sorted(Worker.objects.values_list("pk", "name", "status", "drain_requested_at")), sorted(
        Token.objects.filter(kind=TokenKind.WORKER).values_list("pk", "revoked_at")
    )


@pytest.mark.parametrize(("permission", "method", "path"), PER_ACTION)
def test_each_endpoint_needs_its_own_permission(bearer_client, permission, method, path):
    others = [p for p in WORKER_MANAGER_PERMISSIONS if p != permission]
    worker = WorkerFactory(offline=True)
    worker_token(worker)
    url = path.format(worker=f"{WORKERS}/{worker.pk}")
    refusing, allowed = bearer_client(UserFactory(permissions=others)), bearer_client(UserFactory(permissions=[permission]))
    before = _fleet_state()
    body = {"name": "new-one"} if (method, path) == ("post", WORKERS) else {}  # the others take no field of it

    refused = getattr(refusing, method)(url, body)

    assert refused.status_code == 403
    assert refused.json() == {"code": "permission_denied", "detail": f"You need the {permission} permission"}
    assert _fleet_state() == before
    assert audit_rows() == []
    assert getattr(allowed, method)(url, body).status_code in (200, 201, 204)


# --- list and detail ----------------------------------------------------------------------------------


def test_list_workers_with_status_filter(operator_client):
    idle = WorkerFactory(name="a-idle", labels={"location": "datacenter-a"})
    busy = WorkerFactory(name="b-busy", status=WorkerStatus.BUSY)
    WorkerFactory(name="c-offline", offline=True)

    everyone = operator_client.get(WORKERS).json()["workers"]
    assert [w["name"] for w in everyone] == ["a-idle", "b-busy", "c-offline"]
    first = everyone[0]
    assert (first["id"], first["status"], first["worker_type"], first["labels"]) == (
        idle.pk,
        "idle",
        "persistent",
        {"location": "datacenter-a"},
    )
    assert {"gpu_count", "gpu_name", "last_heartbeat", "draining", "stream_connected"} <= set(first)
    assert "token" not in first
    assert [w["id"] for w in operator_client.get(WORKERS, {"status": "idle"}).json()["workers"]] == [idle.pk]
    assert {w["id"] for w in operator_client.get(WORKERS, {"status": "idle,busy"}).json()["workers"]} == {
        idle.pk,
        busy.pk,
    }


def test_get_one_worker_and_404(operator_client):
    worker = WorkerFactory()

    assert operator_client.get(f"{WORKERS}/{worker.pk}").json()["id"] == worker.pk
    missing = operator_client.get(f"{WORKERS}/w_000000000000")
    assert (missing.status_code, missing.json()["code"]) == (404, "not_found")


# --- create -------------------------------------------------------------------------------------------


def test_create_returns_the_token_once_and_stores_only_its_digest(operator_client, operator):
    response = operator_client.post(
        WORKERS,
        {
            "name": "gpu-worker-1",
            "worker_type": "ephemeral",
            "labels": {"location": "datacenter-a", "gpu_type": "a100"},
        },
        REMOTE_ADDR="10.0.0.9",
    )

    assert response.status_code == 201
    body = response.json()
    plaintext = body["token"]
    assert plaintext.startswith("wt_")
    assert (body["name"], body["worker_type"], body["status"]) == ("gpu-worker-1", "ephemeral", "connecting")
    worker = Worker.objects.get(pk=body["worker_id"])
    assert worker.labels == {"location": "datacenter-a", "gpu_type": "a100"}
    assert worker.created_by == operator
    token = Token.objects.get(worker=worker)
    assert token.digest == hashlib.sha256(plaintext.encode()).hexdigest()
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=plaintext).worker == worker
    # Shown once: no later response carries it.
    assert plaintext not in operator_client.get(WORKERS).content.decode()
    assert plaintext not in operator_client.get(f"{WORKERS}/{worker.pk}").content.decode()
    (created,) = audit_rows(actions.WORKER_CREATED, target_id=worker.pk)
    assert (created.actor_type, created.actor_name, created.client_ip) == ("user", operator.username, "10.0.0.9")
    assert created.details["token_prefix"] == plaintext[:10]
    assert plaintext not in str(created.details)


def test_create_defaults_to_persistent_without_labels(operator_client):
    body = operator_client.post(WORKERS, {"name": "w"}).json()

    assert (body["worker_type"], body["labels"]) == ("persistent", {})


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({}, 400, "invalid"),
        ({"name": ""}, 400, "invalid"),
        ({"name": "   "}, 400, "invalid"),
        ({"name": "w", "worker_type": "local"}, 400, "invalid"),
        ({"name": "w", "worker_type": "spot"}, 400, "invalid"),
        ({"name": "w", "labels": ["a100"]}, 400, "invalid"),
        ({"name": "w", "labels": {"": "a100"}}, 400, "invalid_labels"),
        ({"name": "taken"}, 409, "name_taken"),
    ],
)
def test_bad_create_is_refused_and_creates_nothing(operator_client, body, status, code):
    WorkerFactory(name="taken")

    response = operator_client.post(WORKERS, body)

    assert response.status_code == status
    assert response.json()["code"] == code
    assert Worker.objects.count() == 1
    assert Token.objects.filter(kind=TokenKind.WORKER).count() == 0
    assert audit_rows() == []


# --- delete -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs", [{}, {"status": WorkerStatus.BUSY}, {"draining": True}], ids=["idle", "busy", "draining"]
)
def test_delete_an_online_worker_is_409(operator_client, kwargs):
    worker = WorkerFactory(**kwargs)

    response = operator_client.delete(f"{WORKERS}/{worker.pk}")

    assert response.status_code == 409
    assert response.json()["code"] == "worker_online"
    assert Worker.objects.filter(pk=worker.pk).exists()
    assert audit_rows(actions.WORKER_DELETED) == []


def test_delete_an_offline_worker_keeps_its_jobs_and_revokes_its_tokens(operator_client):
    worker = WorkerFactory(offline=True)
    plaintext = worker_token(worker)
    job = JobFactory(status=JobStatus.COMPLETED, worker=worker, worker_name=worker.name)

    response = operator_client.delete(f"{WORKERS}/{worker.pk}")

    assert response.status_code == 204
    assert not Worker.objects.filter(pk=worker.pk).exists()
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=plaintext) is None
    job = Job.objects.get(pk=job.pk)
    assert (job.worker_id, job.worker_name) == (None, worker.name)
    (deleted,) = audit_rows(actions.WORKER_DELETED, target_id=worker.pk)
    assert deleted.details["name"] == worker.name


def test_delete_a_never_connected_worker(operator_client):
    worker = WorkerFactory(fresh=True)

    assert operator_client.delete(f"{WORKERS}/{worker.pk}").status_code == 204
    assert not Worker.objects.filter(pk=worker.pk).exists()


def test_delete_an_unknown_worker_is_404(operator_client):
    response = operator_client.delete(f"{WORKERS}/w_000000000000")

    assert (response.status_code, response.json()["code"]) == (404, "not_found")


# --- drain --------------------------------------------------------------------------------------------


def test_drain_an_idle_worker(operator_client, commit):
    worker = WorkerFactory()
    JobFactory()

    with commit():
        response = operator_client.post(f"{WORKERS}/{worker.pk}/drain")

    assert response.status_code == 200
    assert (response.json()["status"], response.json()["draining"]) == ("draining", True)
    worker = _reload(worker)
    assert worker.status == WorkerStatus.DRAINING and worker.drain_requested_at
    assert sent_events(worker.pk) == [
        {"channel": f"worker-{worker.pk}", "type": "drain", "data": {"type": "drain", "current_job_id": None}}
    ]
    assert audit_rows(actions.WORKER_DRAIN_REQUESTED, target_id=worker.pk)


def test_drain_a_busy_worker_lets_its_job_finish_then_gives_it_nothing(operator_client, worker_client, commit):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    JobFactory()

    with commit():
        operator_client.post(f"{WORKERS}/{worker.pk}/drain")
    assert (_reload(worker).status, _reload(job).status) == (WorkerStatus.DRAINING, JobStatus.RUNNING)
    assert [e["data"] for e in sent_events(worker.pk)] == [{"type": "drain", "current_job_id": job.pk}]

    with commit():
        worker_client(worker).post(f"/api/workers/job/{job.pk}/status", {"status": "completed"})

    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.DRAINING, None)
    assert _reload(job).status == JobStatus.COMPLETED
    assert [e["type"] for e in sent_events(worker.pk)] == ["drain"]


def test_drain_is_idempotent(operator_client):
    worker = WorkerFactory()

    operator_client.post(f"{WORKERS}/{worker.pk}/drain")
    first = _reload(worker).drain_requested_at
    response = operator_client.post(f"{WORKERS}/{worker.pk}/drain")

    assert response.status_code == 200
    assert _reload(worker).drain_requested_at == first
    assert len(audit_rows(actions.WORKER_DRAIN_REQUESTED)) == 1


def test_drain_an_offline_worker_keeps_it_offline_until_it_returns(operator_client):
    worker = WorkerFactory(offline=True)

    operator_client.post(f"{WORKERS}/{worker.pk}/drain")

    worker = _reload(worker)
    assert (worker.status, worker.drain_requested_at is not None) == (WorkerStatus.OFFLINE, True)


def test_drain_an_unknown_worker_is_404(operator_client):
    assert operator_client.post(f"{WORKERS}/w_000000000000/drain").status_code == 404


# --- rotate -------------------------------------------------------------------------------------------


def test_rotate_token_invalidates_the_old_one_at_once(operator_client, worker_client):
    worker = WorkerFactory(worker_type=WorkerType.PERSISTENT)
    old = worker_token(worker)

    response = operator_client.post(f"{WORKERS}/{worker.pk}/token")

    assert response.status_code == 200
    body = response.json()
    assert (body["worker_id"], body["name"]) == (worker.pk, worker.name)
    new = body["token"]
    assert new.startswith("wt_") and new != old
    assert worker_client(worker, token=old).post("/api/workers/heartbeat", {}).status_code == 401
    assert worker_client(worker, token=new).post("/api/workers/heartbeat", {}).status_code == 200
    assert audit_rows(actions.WORKER_TOKEN_ROTATED, target_id=worker.pk)


def test_rotation_sends_nothing_on_the_worker_feed(operator_client, commit):
    worker = WorkerFactory()
    worker_token(worker)

    with commit():
        operator_client.post(f"{WORKERS}/{worker.pk}/token")

    # Closing the old token's streams is a control message; it is never stored as an event.
    assert sent_events() == []


def test_rotate_for_an_unknown_worker_is_404(operator_client):
    response = operator_client.post(f"{WORKERS}/w_000000000000/token")

    assert (response.status_code, response.json()["code"]) == (404, "not_found")
    assert Token.objects.filter(kind=TokenKind.WORKER).count() == 0
