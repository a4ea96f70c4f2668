"""Issue 12, finding 5: the shape of a request is bounded, and every error under /api/ is JSON.

JSON nested 1,000 deep crashed the register endpoint with a RecursionError before the token was even
checked; a 2 MB ``gpu_info`` was stored. Now: a body over MAX_REQUEST_BYTES is a 413, JSON nested
over MAX_JSON_DEPTH a 400, and whatever answers an /api/ request with an error (DRF, Django, a crash,
DEBUG) answers ``{"code", "detail"}``.
"""

import json
import os
import subprocess
import sys

import pytest
from rest_framework.test import APIClient

from audit import actions
from job_queue.models import Job
from workers.models import WorkerStatus
from workers.tests.factories import WorkerFactory, api_token
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

REGISTER = "/api/workers/register"
SUBMIT = "/api/queue/submit"


def nested(depth, leaf="1"):
    return "[" * depth + leaf + "]" * depth


def _post(client, path, text, **extra):
    return client.post(path, data=text, content_type="application/json", **extra)


def _error(response, status, code):
    assert response.status_code == status, response.content
    assert response["Content-Type"].startswith("application/json"), response["Content-Type"]
    body = response.json()
    assert (body["code"], set(body) - {"errors"}) == (code, {"code", "detail"}), body
    return body


# --- nesting depth ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [33, 1_000, 100_000])
def test_deep_json_before_authentication_is_refused_as_unauthenticated_not_a_crash(api_client, depth):
    response = _post(api_client, REGISTER, '{"name": "x", "gpu_info": ' + nested(depth) + "}")

    _error(response, 401, "not_authenticated")
    (refused,) = audit_rows(actions.AUTH_FAILED)  # the refused token, audited as a failed authentication
    assert refused.details["path"] == REGISTER


@pytest.mark.parametrize("depth", [33, 1_000, 100_000])
def test_deep_json_from_a_worker_is_400(worker_client, depth):
    worker = WorkerFactory(fresh=True)

    body = _error(_post(worker_client(worker), REGISTER, '{"gpu_info": ' + nested(depth - 1) + "}"), 400, "json_too_deep")

    assert body["detail"] == "JSON nested deeper than 32 levels"
    assert worker.status == WorkerStatus.CONNECTING


def test_json_at_the_depth_limit_is_accepted(operator_client):
    deep = json.loads(nested(28, '{"x": 1}'))  # the body, "config", its object, 28 lists, the leaf object: 32 levels

    response = operator_client.post(SUBMIT, {"config_name": "c", "config": {"deep": deep}})

    assert response.status_code == 201, response.content


def test_the_depth_limit_is_a_setting(settings, operator_client):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "MAX_JSON_DEPTH": 8}

    _error(_post(operator_client, SUBMIT, '{"config_name": "c", "config": {"a": ' + nested(7) + "}}"), 400, "json_too_deep")
    assert operator_client.post(SUBMIT, {"config_name": "c", "config": {"a": json.loads(nested(6))}}).status_code == 201


# --- body size -------------------------------------------------------------------------------------------


def test_a_2mb_gpu_info_is_413_and_nothing_is_stored(worker_client):
    worker = WorkerFactory(fresh=True)

    body = _error(_post(worker_client(worker), REGISTER, json.dumps({"gpu_info": {"blob": "x" * 2_000_000}})), 413, "request_too_large")

    assert "at most 1048576" in body["detail"]
    worker.refresh_from_db()
    assert (worker.status, worker.gpu_info) == (WorkerStatus.CONNECTING, {})


def test_the_body_limit_is_a_setting_and_counts_bytes(settings, operator_client):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "MAX_REQUEST_BYTES": 65536}
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 65536  # as settings.py sets it from SIMPLETUNER_MAX_REQUEST_BYTES
    text = json.dumps({"config_name": "c", "config": {"blob": "é" * 40_000}})  # 80,000 bytes in UTF-8

    _error(_post(operator_client, SUBMIT, text), 413, "request_too_large")
    assert Job.objects.count() == 0


def test_the_parser_holds_the_limit_when_djangos_check_is_off(settings, operator_client):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "MAX_REQUEST_BYTES": 65536}
    settings.DATA_UPLOAD_MAX_MEMORY_SIZE = None

    body = _error(_post(operator_client, SUBMIT, json.dumps({"config_name": "c", "config": {"blob": "x" * 70_000}})), 413, "request_too_large")

    assert body["detail"] == "the request body is over 65536 bytes; at most 65536 are accepted"


def test_a_declared_length_over_the_limit_is_refused_before_reading(operator_client):
    response = _post(operator_client, SUBMIT, '{"config_name": "c"}', CONTENT_LENGTH=str(10**12))

    _error(response, 413, "request_too_large")


# --- what a body may be ------------------------------------------------------------------------------------


def test_a_body_that_is_not_utf8_is_400(operator_client):
    body = _error(_post(operator_client, SUBMIT, b'{"config_name": "\xff\xfe"}'), 400, "parse_error")

    assert "not valid UTF-8" in body["detail"]


def test_a_form_encoded_body_is_415(operator_client):
    response = operator_client.post(SUBMIT, data="config_name=c", content_type="application/x-www-form-urlencoded")

    _error(response, 415, "unsupported_media_type")


def test_a_list_body_on_the_queue_endpoint_is_400_not_500(worker_client):
    worker = WorkerFactory()

    _error(_post(worker_client(worker), "/api/workers/queue", "[1, 2]"), 400, "invalid")


def test_an_impossible_date_in_an_audit_filter_is_400(operator_client):
    _error(operator_client.get("/api/audit/?since=2024-02-30T00:00:00"), 400, "invalid_filter")


@pytest.mark.parametrize("field", ["action", "actor_id", "target_id", "actor_type", "target_type"])
def test_a_nul_in_an_audit_filter_is_400(operator_client, field):
    _error(operator_client.get(f"/api/audit/?{field}=x%00"), 400, "invalid_filter")


# --- every error under /api/ is JSON -------------------------------------------------------------------------


@pytest.fixture
def crashing_submit(monkeypatch):
    from job_queue import services

    def crash(**kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(services, "job_submit", crash)


def _crash_client(user):
    client = APIClient(raise_request_exception=False)
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_token(user)}")
    return client


@pytest.mark.parametrize("debug", [False, True])
def test_a_crash_under_api_is_json_500(settings, crashing_submit, operator, debug):
    settings.DEBUG = debug

    response = _post(_crash_client(operator), SUBMIT, '{"config_name": "c"}')

    body = _error(response, 500, "server_error")
    assert "boom" not in body["detail"]  # no stack trace, no exception text


def test_django_level_errors_under_api_are_json(settings, client):
    settings.ALLOWED_HOSTS = ["orchestrator.example.com"]

    response = client.get("/api/queue/", HTTP_HOST="evil.example.com")

    _error(response, 400, "bad_request")


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("get", "/api/nowhere", 404, "not_found"),
        ("get", "/api/queue/j_x/cancel/more", 404, "not_found"),
        ("delete", "/api/queue/submit", 405, "method_not_allowed"),
    ],
)
def test_unknown_paths_and_methods_under_api_are_json(operator_client, method, path, status, code):
    _error(getattr(operator_client, method)(path), status, code)


def test_errors_outside_api_stay_html(client, settings):
    settings.DEBUG = False

    response = client.get("/nowhere")

    assert response.status_code == 404
    assert response["Content-Type"].startswith("text/html")


# --- the limits are settings, checked at start-up -------------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "raw", "message"),
    [
        ("SIMPLETUNER_MAX_REQUEST_BYTES", "lots", "must be an integer"),
        ("SIMPLETUNER_MAX_REQUEST_BYTES", "1000", "must be >= 65536"),
        ("SIMPLETUNER_MAX_JSON_DEPTH", "100000", "must be <= 200"),
        ("SIMPLETUNER_MAX_LABELS", "0", "must be >= 1"),
        ("SIMPLETUNER_JOB_MAX_RETRIES", str(2**31), "must be <= 100"),
    ],
)
def test_a_bad_limit_stops_start_up(tmp_path, variable, raw, message):
    env = {**os.environ, "SIMPLETUNER_DATA_DIR": str(tmp_path), variable: raw}

    result = subprocess.run(
        [sys.executable, "-c", "import simpletuner_site.settings"], env=env, capture_output=True, text=True, timeout=120
    )

    assert result.returncode != 0
    assert f"ImproperlyConfigured: {variable} {message}" in result.stderr


def test_the_defaults(settings):
    assert {k: settings.SIMPLETUNER[k] for k in ("MAX_REQUEST_BYTES", "MAX_JSON_DEPTH", "MAX_LABELS", "MAX_GPU_INFO_BYTES")} == {
        "MAX_REQUEST_BYTES": 1024 * 1024,
        "MAX_JSON_DEPTH": 32,
        "MAX_LABELS": 32,
        "MAX_GPU_INFO_BYTES": 64 * 1024,
    }
    assert settings.DATA_UPLOAD_MAX_MEMORY_SIZE == 1024 * 1024


# --- every field a client sends has a declared bound -------------------------------------------------------------

# Trainer output is cut to its length, never refused (common.fields.TrainerText): no maxLength to declare.
CUT_NOT_REFUSED = {("JobStatusReportRequest", "error")}


def test_every_string_and_integer_a_client_sends_declares_its_bounds(operator_client):
    schema = operator_client.get("/api/schema/", {"format": "json"}).json()
    requests = {name: body for name, body in schema["components"]["schemas"].items() if name.endswith("Request")}
    assert {"RegisterRequest", "HeartbeatRequest", "JobStatusReportRequest", "JobSubmitRequest", "WorkerCreateRequest"} <= set(requests)

    unbounded = []
    for name, body in requests.items():
        for field, spec in body.get("properties", {}).items():
            kind = spec.get("type")
            if kind == "string" and "enum" not in spec and "maxLength" not in spec and (name, field) not in CUT_NOT_REFUSED:
                unbounded.append(f"{name}.{field}: string without maxLength")
            if kind in ("integer", "number") and not {"minimum", "maximum"} <= set(spec):
                unbounded.append(f"{name}.{field}: {kind} without minimum and maximum")
    assert unbounded == []


# --- the admin's query strings ---------------------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("path", "query"),
    [
        ("/admin/workers/worker/", "q=evil%00"),
        ("/admin/workers/worker/", "status__exact=idle%00"),
        ("/admin/queue/job/", "q=%00"),
        ("/admin/queue/job/", "worker__id__exact=w%00"),
        ("/admin/audit/auditevent/", "q=%00"),
    ],
)
def test_admin_searches_and_filters_with_unstorable_text_are_400_not_a_crash(staff_client, path, query):
    client = staff_client("workers.view_worker", "queue.view_job", "audit.view_auditevent")
    assert client.get(path).status_code == 200
    response = client.get(f"{path}?{query}")
    assert response.status_code == 400
    assert b"Bad request" in response.content
