"""Unknown fields are refused (issue 32, item 5): every write route of the URL configuration, walked, answers a
field it does not take with a 400 naming it and changes nothing; the same body without it is served.

The fields SimpleTuner's released agent sends (UPSTREAM-PROTOCOL.md) are all taken, and so is everything our own
agent sends (``worker_agent.protocol``'s request shapes, its real capabilities and samples). A new write route
without a case here fails ``test_every_write_route_has_a_case``.
"""

import json

import pytest
from django.urls import reverse

from common.fields import TrainerLogLines
from common.serializers import UNKNOWN_NAMED_MAX
from job_queue.models import Job
from worker_agent import protocol
from worker_agent.gpu import GpuMonitor
from workers.api.serializers import HeartbeatSerializer, JobStatusReportSerializer, RegisterSerializer, WorkerIdSerializer
from workers.models import Worker

from .test_authorisation_matrix import World, _client, _upload_client, discovered_routes, state

UNKNOWN = "not_a_field"
WRITES = {"POST", "PUT", "PATCH"}

# (route name, method) -> why the route has no JSON fields to refuse.
NO_FIELDS = {
    ("artifact-object", "PUT"): "the body is the file itself (S3-style): its name is the path, its metadata headers",
    ("login", "POST"): "the browsable API's HTML sign-in form (Django's LoginView), not a JSON endpoint",
    ("login", "PUT"): "the same form view (Django's views take PUT as they take POST)",
    ("logout", "POST"): "the browsable API's sign-out (Django's LogoutView): a form button with no fields",
}

# Every field SimpleTuner's released agent sends, per endpoint (UPSTREAM-PROTOCOL.md); its queue check is a GET.
UPSTREAM_GPU_INFO = {"name": "NVIDIA A100-SXM4-80GB", "vram_gb": 80.0, "count": 2, "driver": "12.4", "accelerator": "cuda"}


def upstream_register(world):
    return {"name": "worker-a", "gpu_info": UPSTREAM_GPU_INFO, "persistent": True, "current_job_id": world.a_job.pk}


def upstream_heartbeat(world):
    return {"worker_id": world.a.pk, "status": "busy", "current_job_id": world.a_job.pk}


# (route name, method) -> (caller, valid body): the body is served (2xx) as it is, refused with UNKNOWN beside it.
CASES = {
    ("worker-register", "POST"): ("worker", upstream_register),
    ("worker-heartbeat", "POST"): ("worker", upstream_heartbeat),
    ("worker-job-status", "POST"): ("worker", lambda w: {"status": "running", "error": None, "attempt": w.a_job.lease_id}),
    ("worker-queue", "POST"): ("worker", lambda w: {"worker_id": w.a.pk}),
    ("worker-disconnect", "POST"): ("worker", lambda w: {"worker_id": w.a.pk}),
    ("checkpoint-complete", "POST"): ("upload", lambda w: {}),
    ("config-list", "POST"): ("operator", lambda w: {"name": "sdxl-lora", "config": {"learning_rate": 1e-4}}),
    ("config-list-slash", "POST"): ("operator", lambda w: {"name": "sdxl-lora", "config": {"learning_rate": 1e-4}}),
    ("admin-workers", "POST"): ("operator", lambda w: {"name": "gpu-new", "labels": {"gpu": "a100"}}),
    ("admin-worker-drain", "POST"): ("operator", lambda w: {}),
    ("admin-worker-undrain", "POST"): ("operator", lambda w: {}),
    ("admin-worker-token", "POST"): ("operator", lambda w: {"force": False}),
    ("admin-worker-labels", "PUT"): ("operator", lambda w: {"labels": {"gpu": "a100"}}),
    ("queue-submit", "POST"): ("operator", lambda w: {"config_name": "sdxl-lora", "worker_labels": {"gpu": "a100*"}}),
    ("queue-job-cancel", "POST"): ("operator", lambda w: {}),
    ("queue-job-retry", "POST"): ("operator", lambda w: {}),
    ("admin-webhooks", "POST"): (
        "operator", lambda w: {"url": "https://93.184.215.14/hook", "events": ["job.failed"], "secret": "s" * 20}
    ),
    ("admin-webhook", "PATCH"): ("operator", lambda w: {"active": False}),
    ("admin-webhook-redeliver", "POST"): ("operator", lambda w: {}),
    ("admin-teams", "POST"): ("operator", lambda w: {"name": "new-team", "members": []}),
    ("admin-team", "PATCH"): ("operator", lambda w: {"members": [], "limits": {"max_gpus": 2}}),
    ("admin-team-limits", "PUT"): ("operator", lambda w: {"max_gpus": 2}),
    ("admin-user-limits", "PUT"): ("operator", lambda w: {"max_running_jobs": 1}),
    ("admin-limits", "PUT"): ("operator", lambda w: {"gpu_hours_per_30_days": 100.0}),
}


@pytest.fixture(autouse=True)
def no_throttling(settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"failed_auth": "100000/min"}}


def test_every_write_route_has_a_case():
    writes = {(name, method) for name, method in discovered_routes() if method in WRITES}
    assert writes == set(CASES) | set(NO_FIELDS)


def _caller(world, kind):
    if kind == "worker":
        return _client(HTTP_X_WORKER_TOKEN=world.a_token)
    if kind == "upload":
        return _upload_client(world.upload_token)
    return _client(HTTP_AUTHORIZATION=f"Bearer {world.operator_token}")


def _send(client, method, url, body):
    return getattr(client, method.lower())(url, body, format="json")


def _world():
    world = World()
    # The attempt's checkpoint of step 5 (the checkpoint-complete case's) has a file.
    put = _upload_client(world.upload_token).put(
        world.url("artifact-object"), b"weights", content_type="application/octet-stream"
    )
    assert put.status_code == 201, put.content
    return world


def _assert_refused(response, *names):
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["code"] == "invalid" and body["detail"], body
    for name in names:
        assert body["errors"][name][0].startswith("Unknown field"), body


@pytest.mark.django_db
@pytest.mark.parametrize(("name", "method"), sorted(CASES), ids=[f"{m} {n}" for n, m in sorted(CASES)])
def test_an_unknown_field_is_refused_naming_it_and_changes_nothing(name, method):
    world = _world()
    kind, valid = CASES[(name, method)]
    client, url, body = _caller(world, kind), world.url(name), valid(world)
    before = state()

    refused = _send(client, method, url, {**body, UNKNOWN: 1})

    _assert_refused(refused, UNKNOWN)
    assert state() == before
    served = _send(client, method, url, body)
    assert 200 <= served.status_code < 300, served.content  # the same body without it is taken


@pytest.mark.django_db
def test_labels_for_worker_labels_is_refused_with_the_field_it_meant_and_no_job_is_made(operator_client):
    """The slip of the issue: ``labels`` made a job with no selector, which ran on any worker."""
    response = operator_client.post("/api/queue/submit", {"config_name": "c", "labels": {"gpu": "a100"}})

    _assert_refused(response, "labels")
    assert "Did you mean worker_labels?" in response.json()["errors"]["labels"][0]
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_every_unknown_field_is_named_beside_the_other_errors_up_to_a_bound(operator_client):
    many = {f"extra_{n:02}": n for n in range(UNKNOWN_NAMED_MAX + 5)}

    response = operator_client.post("/api/admin/workers", {"name": 5, **many})

    _assert_refused(response, *list(many)[:UNKNOWN_NAMED_MAX])
    errors = response.json()["errors"]
    assert errors["name"] == ["Must be a string."]  # the declared fields are still checked
    assert errors["non_field_errors"] == ["5 more unknown fields"]
    assert len(errors) == UNKNOWN_NAMED_MAX + 2
    assert not Worker.objects.exists()


@pytest.mark.django_db
@pytest.mark.parametrize("key", ['"a\\ud800"', '"a\\u0000b"', '"' + "k" * 5000 + '"'])
def test_any_unknown_name_is_answered_as_json(operator_client, key):
    response = operator_client.post("/api/queue/submit", '{"config_name": "c", ' + key + ": 1}", content_type="application/json")

    assert response.status_code == 400, response.content
    (shown,) = set(response.json()["errors"])
    assert len(shown) <= 100 and "\x00" not in shown
    assert not Job.objects.exists()


@pytest.mark.django_db
def test_a_body_on_a_route_that_takes_none_is_refused(operator_client):
    job = Job.objects.create(config_name="c")

    assert operator_client.post(f"/api/queue/{job.pk}/cancel", [1], format="json").status_code == 400
    _assert_refused(operator_client.post(f"/api/queue/{job.pk}/cancel", {"force": True}), "force")
    assert Job.objects.get(pk=job.pk).status == "queued"
    assert operator_client.post(f"/api/queue/{job.pk}/cancel", {}).status_code == 200


# --- nested objects: user data is free-form, a schema refuses unknown keys -------------------------------


@pytest.mark.django_db
def test_user_data_and_hardware_descriptions_keep_any_key(operator_client, worker_client):
    """A job's and a stored config's ``config`` and ``dataloader``, a trainer's ``progress``, an agent's ``gpu_info``
    and ``gpus``: objects whose keys are the sender's, taken as they are."""
    world = World()
    free = {"any_key": 1, "nested": {"also": True}}
    submitted = operator_client.post("/api/queue/submit", {"config_name": "c", "config": free, "dataloader": [free]})
    stored = operator_client.post("/api/configs", {"name": "cfg", "config": free, "dataloader": free})
    worker = _client(HTTP_X_WORKER_TOKEN=world.a_token)
    registered = worker.post(
        reverse("worker-register"),
        {**upstream_register(world), "gpu_info": {**UPSTREAM_GPU_INFO, "new_key": 1}, "gpus": [{"index": 0, "x": 1}]},
        format="json",
    )
    progress = {"step": 5, "loss": 0.1, "whatever_the_trainer_says": "kept"}
    reported = worker.post(
        world.url("worker-job-status"), {"status": "running", "attempt": world.a_job.lease_id, "progress": progress}, format="json"
    )

    assert [r.status_code for r in (submitted, stored, registered, reported)] == [201, 201, 200, 200]
    assert Job.objects.get(pk=world.a_job.pk).progress["whatever_the_trainer_says"] == "kept"


@pytest.mark.django_db
def test_a_run_of_log_lines_takes_only_from_and_lines():
    world = World()
    worker = _client(HTTP_X_WORKER_TOKEN=world.a_token)
    url, attempt = world.url("worker-job-status"), world.a_job.lease_id
    before = state()

    refused = worker.post(url, {"status": "running", "attempt": attempt, "log_lines": {"from": 0, "lines": ["a"], "to": 1}}, format="json")

    assert refused.status_code == 400
    assert "'to'" in refused.json()["errors"]["log_lines"][0]
    assert state() == before
    taken = worker.post(url, {"status": "running", "attempt": attempt, "log_lines": {"from": 0, "lines": ["a"]}}, format="json")
    assert taken.status_code == 200


# --- what the agents send is all taken ---------------------------------------------------------------------


def _taken(serializer_class):
    return {name for name, field in serializer_class().fields.items() if not field.read_only}


def test_every_field_the_upstream_agent_sends_is_taken():
    assert {"name", "gpu_info", "persistent", "current_job_id"} <= _taken(RegisterSerializer)
    assert {"worker_id", "status", "current_job_id"} <= _taken(HeartbeatSerializer)
    assert {"status", "error", "progress"} <= _taken(JobStatusReportSerializer)
    assert {"worker_id"} <= _taken(WorkerIdSerializer)


def test_every_field_our_agent_sends_is_taken():
    """The protocol's request shapes, and what this machine's agent really sends (its capabilities and samples)."""
    monitor = GpuMonitor(torch_probe=lambda: False)
    register = set(protocol.RegisterRequest.__annotations__)
    heartbeat = set(protocol.HeartbeatRequest.__annotations__) | set(protocol.HEARTBEAT_METRIC_FIELDS)

    assert register <= _taken(RegisterSerializer)
    assert set(monitor.capabilities()) <= register
    assert heartbeat <= _taken(HeartbeatSerializer)
    assert set(monitor.sample()) <= heartbeat
    assert set(protocol.JobReport.__annotations__) <= _taken(JobStatusReportSerializer)
    assert {protocol.LOG_LINES_FROM, *protocol.LogLines.__annotations__} == set(TrainerLogLines.KEYS)


@pytest.mark.django_db
def test_the_schema_says_a_request_body_takes_no_other_property():
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    components = schema["components"]["schemas"]
    bodies = {
        operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
        for path in schema["paths"].values()
        for operation in path.values()
        if isinstance(operation, dict) and "application/json" in operation.get("requestBody", {}).get("content", {})
    }
    assert {"JobSubmitRequest", "RegisterRequest", "HeartbeatRequest", "WorkerLabelsRequest"} <= bodies
    assert {name: components[name].get("additionalProperties") for name in bodies} == dict.fromkeys(bodies, False)
    assert "additionalProperties" not in components["Job"]  # responses are not closed: fields may be added
    assert json.dumps(schema)  # still one JSON document
