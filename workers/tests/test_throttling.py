"""Failed token authentication: throttled per client address (429 + Retry-After) and audited in bounded form."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from asgiref.sync import async_to_sync
from django.core.cache import caches
from django.test import AsyncClient

from audit import actions
from audit.models import AuditEvent
from job_queue.tests.factories import job_on_worker
from workers import throttling
from workers.tests.factories import UserFactory, WorkerFactory, api_token, worker_token
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

REGISTER = "/api/workers/register"
HEARTBEAT = "/api/workers/heartbeat"
JOBS = "/api/queue/"
RATE = 3


@pytest.fixture(autouse=True)
def rate(settings):
    """RATE failures a minute per address, for this test."""
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"failed_auth": f"{RATE}/min"}}


@pytest.fixture
def clock(monkeypatch):
    """The throttle's clock, in seconds; ``clock[0] += 60`` moves it on a window."""
    now = [1_699_999_990.0]  # 10 s into a minute
    monkeypatch.setattr(throttling.FailedAuthenticationThrottle, "timer", lambda self: now[0])
    return now


def _bad_heartbeat(api_client, address="203.0.113.5", token="wt_not-a-real-token"):
    return api_client.post(HEARTBEAT, {}, HTTP_X_WORKER_TOKEN=token, REMOTE_ADDR=address)


def test_past_the_rate_a_refused_token_is_429_with_retry_after(api_client, clock):
    answers = [_bad_heartbeat(api_client) for _ in range(RATE + 2)]

    assert [a.status_code for a in answers] == [401] * RATE + [429, 429]
    throttled = answers[-1]
    assert throttled.json()["code"] == "throttled"
    assert throttled.json()["detail"].startswith("Too many failed authentications from this address.")
    assert throttled["Retry-After"] == "50"  # the rest of the minute


def test_a_flood_writes_two_audit_rows_per_address_and_window_recording_only_the_prefix(api_client, clock):
    for _ in range(100):
        _bad_heartbeat(api_client, token="wt_secretvalue-never-recorded")

    failed, throttled = audit_rows()
    assert (failed.action, throttled.action) == (actions.AUTH_FAILED, actions.AUTH_THROTTLED)
    assert {row.client_ip for row in (failed, throttled)} == {"203.0.113.5"}
    assert {row.success for row in (failed, throttled)} == {False}
    assert failed.details == {
        "kind": "worker",
        "token_prefix": "wt_secretv",
        "path": HEARTBEAT,
        "reason": "Invalid token: it may have been rotated; request a new one",
        "window_seconds": 60,
        "failures_in_previous_window": 0,
    }
    assert throttled.details == {
        "kind": "worker",
        "token_prefix": "wt_secretv",
        "path": HEARTBEAT,
        "failures": RATE + 1,
        "window_seconds": 60,
        "retry_after": 50,
    }
    assert not AuditEvent.objects.filter(details__icontains="secretvalue").exists()


def test_the_next_window_opens_again_and_records_the_count_of_the_one_before(api_client, clock):
    for _ in range(10):
        _bad_heartbeat(api_client)
    clock[0] += 60

    assert _bad_heartbeat(api_client).status_code == 401

    newest = audit_rows()[-1]
    assert newest.action == actions.AUTH_FAILED
    assert newest.details["failures_in_previous_window"] == 10
    assert len(audit_rows()) == 3


def test_each_address_has_its_own_count_and_an_ipv6_network_one(api_client, clock):
    for _ in range(RATE + 1):
        _bad_heartbeat(api_client, address="198.51.100.1")

    assert _bad_heartbeat(api_client, address="198.51.100.2").status_code == 401
    for n in range(RATE):
        _bad_heartbeat(api_client, address=f"2001:db8:1:2::{n + 1}")
    assert _bad_heartbeat(api_client, address="2001:db8:1:2:ffff::9").status_code == 429  # the same /64
    assert _bad_heartbeat(api_client, address="2001:db8:1:3::1").status_code == 401


def test_a_valid_token_from_a_throttled_address_is_served_without_touching_the_counters(
    api_client, worker_client, clock, monkeypatch
):
    worker = WorkerFactory()
    for _ in range(RATE + 1):
        _bad_heartbeat(api_client)

    def untouchable(*args, **kwargs):
        raise AssertionError("a successful authentication touched the failure counters")

    for method in ("get", "add", "incr", "set"):
        monkeypatch.setattr(caches["default"], method, untouchable)
    response = worker_client(worker).post(HEARTBEAT, {"status": "idle"}, REMOTE_ADDR="203.0.113.5")

    assert response.status_code == 200


@pytest.mark.parametrize(
    "header",
    ["Bearer sta_not-a-real-token", "Bearer ", "Bearer revoked"],
    ids=["unknown", "empty", "revoked"],
)
def test_failed_bearer_tokens_are_audited_and_throttled_too(api_client, clock, header):
    if header == "Bearer revoked":
        user = UserFactory(groups=["viewer"])
        header = f"Bearer {api_token(user)}"
        user.api_tokens.update(revoked_at="2024-01-01T00:00:00Z")

    answers = [api_client.get(JOBS, HTTP_AUTHORIZATION=header, REMOTE_ADDR="192.0.2.77") for _ in range(RATE + 1)]

    assert [a.status_code for a in answers] == [401] * RATE + [429]
    assert answers[0]["WWW-Authenticate"] == "Bearer"
    failed, throttled = audit_rows()
    assert (failed.action, failed.actor_type, failed.details["kind"]) == (actions.AUTH_FAILED, "user", "operator")
    assert failed.details["token_prefix"] == header.partition(" ")[2][:10]
    assert throttled.action == actions.AUTH_THROTTLED


def test_a_request_without_credentials_on_an_operator_endpoint_is_not_counted(api_client, clock):
    answers = [api_client.get(JOBS, REMOTE_ADDR="192.0.2.78") for _ in range(RATE + 2)]

    assert {a.status_code for a in answers} == {401}
    assert audit_rows() == []


def test_a_refused_token_changes_nothing_but_the_bounded_audit(api_client, clock):
    worker = WorkerFactory()
    job = job_on_worker(worker)
    revoked = worker_token(worker)
    worker.tokens.update(revoked_at="2024-01-01T00:00:00Z")
    before = (worker.status, worker.last_heartbeat, job.status)

    for _ in range(RATE + 5):
        api_client.post(f"/api/workers/job/{job.pk}/status", {"status": "completed"}, HTTP_X_WORKER_TOKEN=revoked)

    worker.refresh_from_db()
    job.refresh_from_db()
    assert (worker.status, worker.last_heartbeat, job.status) == before
    assert [row.action for row in audit_rows()] == [actions.AUTH_FAILED, actions.AUTH_THROTTLED]


def test_an_unreachable_cache_still_counts_in_the_process(api_client, clock, monkeypatch, caplog):
    class Down:
        def __getattr__(self, name):
            def fail(*args, **kwargs):
                raise ConnectionError("Redis is down")

            return fail

    monkeypatch.setattr(throttling, "cache", Down())

    answers = [_bad_heartbeat(api_client) for _ in range(RATE + 3)]

    assert [a.status_code for a in answers] == [401] * RATE + [429] * 3
    assert len(audit_rows()) == 2
    assert "cache unreachable (Redis is down); counting in this process" in caplog.text


@pytest.mark.django_db(transaction=True)
def test_the_worker_stream_refuses_bad_tokens_the_same_way(clock):
    client = AsyncClient()

    def stream(**headers):
        return async_to_sync(client.get)("/api/workers/stream", headers=headers)

    answers = [stream(**{"X-Worker-Token": "wt_nope"}) for _ in range(RATE)] + [stream()]

    assert [a.status_code for a in answers] == [401] * RATE + [429]
    assert answers[-1]["Retry-After"] == "50"
    assert answers[-1].json()["code"] == "throttled"
    failed, throttled = audit_rows()
    assert (failed.action, failed.details["path"], failed.details["token_prefix"]) == (
        actions.AUTH_FAILED,
        "/api/workers/stream",
        "wt_nope",
    )
    assert throttled.details["token_prefix"] == ""


@pytest.mark.redis
def test_with_redis_the_counters_are_shared_through_it(redis_url, api_client, clock, monkeypatch):
    from django.core.cache.backends.redis import RedisCache

    shared = RedisCache(redis_url, {"KEY_PREFIX": "simpletuner-test"})
    key = throttling.FailedAuthenticationThrottle().key("203.0.113.5", int(clock[0] // 60))
    shared.delete(key)
    monkeypatch.setattr(throttling, "cache", shared)
    try:
        answers = [_bad_heartbeat(api_client) for _ in range(RATE + 1)]
        assert shared.get(key) == RATE + 1  # what another server process reads
    finally:
        shared.delete(key)
    assert [a.status_code for a in answers] == [401] * RATE + [429]


@pytest.mark.parametrize(
    ("variable", "scope"),
    [("SIMPLETUNER_FAILED_AUTH_RATE", "failed_auth"), ("SIMPLETUNER_FAILED_LOGIN_RATE", "failed_login")],
    ids=["tokens", "sign-ins"],
)
@pytest.mark.parametrize(
    ("raw", "fine"), [("30/min", True), ("5/s", True), ("100/hour", True), ("ten/min", False), ("0/min", False)]
)
def test_the_rate_comes_from_the_environment_and_a_bad_one_stops_start_up(tmp_path, variable, scope, raw, fine):
    code = f"import simpletuner_site.settings as s; print(s.REST_FRAMEWORK['DEFAULT_THROTTLE_RATES']['{scope}'])"
    env = {**os.environ, "SIMPLETUNER_DATA_DIR": str(tmp_path), variable: raw}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True
    )
    if fine:
        assert (result.returncode, result.stdout.strip()) == (0, raw)
    else:
        assert result.returncode != 0
        assert f"{variable} must look like 30/min" in result.stderr

