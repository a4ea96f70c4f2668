"""The heartbeat's lean path (``serving.heartbeat``): a heartbeat that changes no state is answered
without DRF and its transaction, exactly as before; every other heartbeat falls through to ``worker_heartbeat``."""

import asyncio
import json
import re
import threading
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.db import OperationalError, connection
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from artifacts.models import Checkpoint
from audit import actions
from audit.models import AuditEvent
from audit.services import Actor
from job_queue import agents
from job_queue.models import JobStatus
from serving.heartbeat import LivenessWriter
from job_queue.tests.factories import JobFactory, job_on_worker
from serving.asgi import PooledASGIHandler
from simpletuner_site.asgi import application
from simpletuner_site.tests.asgi_support import asgi_request
from worker_agent import protocol
from workers.models import Token, Worker, WorkerStatus
from workers.services import worker_rotate_token
from workers.api.serializers import HeartbeatSerializer
from workers.tests.factories import WorkerFactory, worker_token
from workers.tests.support import audit_rows, clear_failed_auth_counters

pytestmark = pytest.mark.django_db(transaction=True)

LONG_AGO = timedelta(minutes=5)


async def _post(app, body, *, token=None, headers=(), path=protocol.HEARTBEAT_PATH):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    head = [(b"content-type", b"application/json"), (b"accept", b"application/json"),
            (b"content-length", str(len(raw)).encode())]
    if token is not None:
        head.append((protocol.WORKER_TOKEN_HEADER.lower().encode(), token.encode()))
    return await asgi_request(app, "POST", path, body=raw, headers=head + list(headers))


def post(body, **kwargs):
    """POST a heartbeat through the whole ASGI application (lean path first): (status, headers, body)."""
    return async_to_sync(_post)(application, body, **kwargs)


def post_full(body, *, handler=None, **kwargs):
    """POST it straight to the Django handler (HeartbeatView), as every heartbeat went before (``handler``: one
    built under the settings in force, since Django's middleware reads its settings when built)."""
    return async_to_sync(_post)(handler or application.requests, body, **kwargs)


@pytest.fixture
def full_path(monkeypatch):
    """The heartbeats that reached ``worker_heartbeat`` (the full path), by worker id."""
    calls = []
    original = agents.worker_heartbeat

    def spy(*, worker_id, data, actor):
        calls.append(worker_id)
        return original(worker_id=worker_id, data=data, actor=actor)

    monkeypatch.setattr(agents, "worker_heartbeat", spy)
    return calls


def _worker(**kwargs):
    return WorkerFactory(last_heartbeat=timezone.now() - LONG_AGO, **kwargs)


def _reload(obj):
    obj.refresh_from_db()
    return obj


# --- answered by the lean path ---------------------------------------------------------------------


def test_an_idle_worker_heartbeat_is_answered_by_the_lean_path_and_records_liveness(full_path):
    worker = _worker(metrics={"cpu_percent": 1.0})
    before = worker.last_heartbeat

    status, _, body = post(
        {"worker_id": worker.pk, "status": "idle", "current_job_id": None, "gpu_utilization": [12.5], "cpu_percent": 3},
        token=worker_token(worker),
    )

    assert status == 200
    assert json.loads(body) == {"status": "idle", "draining": False, "current_job_id": None, "current_attempt": None}
    assert full_path == []
    worker = _reload(worker)
    assert worker.last_heartbeat > before
    assert worker.metrics == {"gpu_utilization": [12.5], "cpu_percent": 3.0}  # validated as the serializer does
    assert AuditEvent.objects.count() == 0  # liveness is not audited


def test_a_heartbeat_without_metrics_keeps_the_last_ones(full_path):
    worker = _worker(metrics={"cpu_percent": 1.0})

    status, _, _ = post({"status": "idle"}, token=worker_token(worker))

    assert (status, full_path) == (200, [])
    assert _reload(worker).metrics == {"cpu_percent": 1.0}


def test_a_draining_worker_heartbeat_stays_draining(full_path):
    worker = _worker(draining=True)

    status, _, body = post({"status": "idle", "current_job_id": None}, token=worker_token(worker))

    assert json.loads(body) == {"status": "draining", "draining": True, "current_job_id": None, "current_attempt": None}
    assert (status, full_path, _reload(worker).status) == (200, [], WorkerStatus.DRAINING)


@pytest.mark.parametrize("names_attempt", [True, False])
def test_a_busy_worker_naming_its_acknowledged_job_is_answered_by_the_lean_path(full_path, names_attempt):
    worker = _worker()
    job = job_on_worker(worker)
    body = {"status": "busy", "current_job_id": job.pk, "progress": None, "log_tail": None}
    if names_attempt:
        body["attempt"] = job.lease_id

    status, _, answer = post(body, token=worker_token(worker))

    assert status == 200
    assert json.loads(answer) == {"status": "busy", "draining": False, "current_job_id": job.pk,
                                  "current_attempt": job.lease_id}
    assert full_path == []
    assert _reload(worker).last_heartbeat > timezone.now() - LONG_AGO
    assert AuditEvent.objects.count() == 0


@pytest.mark.parametrize("case", ["idle", "draining", "busy"])
@pytest.mark.parametrize("secure", [False, True])
def test_the_lean_answer_is_the_full_paths_byte_for_byte(full_path, case, secure):
    worker = _worker(draining=case == "draining")
    body = {"worker_id": worker.pk, "status": "idle", "cpu_percent": 2.5}
    if case == "busy":
        job = job_on_worker(worker)
        body.update(status="busy", current_job_id=job.pk, attempt=job.lease_id)
    token = worker_token(worker)
    proxy = [(b"x-forwarded-proto", b"https")] if secure else []
    with override_settings(SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https") if secure else None,
                           SECURE_HSTS_SECONDS=3600):
        lean = post(body, token=token, headers=proxy)
        assert full_path == []
        full = post_full(body, token=token, headers=proxy, handler=PooledASGIHandler())
    assert len(full_path) == 1  # the second went through HeartbeatView
    assert lean == full
    assert (b"Strict-Transport-Security" in lean[1]) is secure


# --- what falls through, and gets today's answer -----------------------------------------------------


def test_an_offline_worker_falls_through_and_comes_back(full_path):
    worker = _worker(offline=True)

    status, _, body = post({"status": "idle"}, token=worker_token(worker))

    assert (status, json.loads(body)["status"], full_path) == (200, "idle", [worker.pk])
    (change,) = audit_rows(actions.WORKER_STATUS_CHANGED, target_id=worker.pk)
    assert change.details["reason"] == "heartbeat after being offline"


def test_a_heartbeat_naming_a_dispatched_job_falls_through_and_acknowledges_it(full_path):
    worker = _worker()
    job = job_on_worker(worker, status=JobStatus.DISPATCHED)

    status, _, body = post({"status": "busy", "current_job_id": job.pk, "attempt": job.lease_id}, token=worker_token(worker))

    assert (status, json.loads(body)["current_attempt"], full_path) == (200, job.lease_id, [worker.pk])
    assert _reload(job).status == JobStatus.RUNNING


def test_a_heartbeat_with_progress_falls_through_and_stores_it(full_path):
    worker = _worker()
    job = job_on_worker(worker)

    status, _, _ = post({"status": "busy", "current_job_id": job.pk, "progress": {"step": 10, "total": 100},
                         "log_tail": ["a"]}, token=worker_token(worker))

    assert (status, full_path) == (200, [worker.pk])
    job = _reload(job)
    assert (job.progress, job.log_tail) == ({"step": 10, "total": 100}, "a")


def test_a_heartbeat_naming_a_job_not_its_own_falls_through_to_the_audited_refusal(full_path):
    worker = _worker()
    foreign = job_on_worker(WorkerFactory())

    status, _, body = post({"status": "busy", "current_job_id": foreign.pk}, token=worker_token(worker))

    assert (status, json.loads(body)["abandon_job"], full_path) == (409, foreign.pk, [worker.pk])
    assert AuditEvent.objects.filter(action="job.report_refused", target_id=foreign.pk).count() == 1
    assert _reload(worker).last_heartbeat < timezone.now() - LONG_AGO + timedelta(seconds=1)


def test_a_heartbeat_naming_another_attempt_falls_through(full_path):
    worker = _worker()
    job = job_on_worker(worker)

    status, _, body = post({"status": "busy", "current_job_id": job.pk, "attempt": "an-old-one"}, token=worker_token(worker))

    assert (status, json.loads(body)["current_attempt"], full_path) == (200, job.lease_id, [worker.pk])


def test_an_idle_agent_holding_a_cancelled_job_falls_through_and_is_freed(full_path):
    worker = _worker()
    job = job_on_worker(worker)
    type(job).objects.filter(pk=job.pk).update(status=JobStatus.CANCELLED)

    status, _, _ = post({"status": "idle", "current_job_id": None}, token=worker_token(worker))

    assert (status, full_path) == (200, [worker.pk])
    assert (_reload(worker).status, worker.current_job_id) == (WorkerStatus.IDLE, None)


def test_a_heartbeat_after_a_checkpoint_upload_falls_through_and_completes_it(full_path):
    worker = _worker()
    job = job_on_worker(worker)
    checkpoint = Checkpoint.objects.create(job_id=job.pk, step=100, lease_id=job.lease_id, attempt_number=1,
                                           last_upload_at=timezone.now() - timedelta(seconds=5))

    status, _, _ = post({"status": "busy", "current_job_id": job.pk, "attempt": job.lease_id}, token=worker_token(worker))

    assert (status, full_path) == (200, [worker.pk])
    assert _reload(checkpoint).completed_at is not None
    assert audit_rows(actions.CHECKPOINT_COMPLETED)


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"cpu_percent": "lots"}, 400, "invalid"),
        ({"worker_id": 12}, 400, "invalid"),
        ({"status": "x" * 33}, 400, "invalid"),
        ({"status": "idle", "labels": {"gpu": "a100"}}, 400, "invalid"),  # a field the heartbeat does not take
        ([1, 2], 400, "invalid"),
        (b"{not json", 400, "parse_error"),
        (b'{"status": "' + b"x" * 2_000_000 + b'"}', 413, "request_too_large"),
    ],
)
def test_a_body_the_serializer_refuses_gets_the_full_paths_answer(full_path, body, status, code):
    worker = _worker()
    token = worker_token(worker)

    lean = post(body, token=token)
    full = post_full(body, token=token)

    assert lean == full
    assert lean[0] == status
    assert json.loads(lean[2])["code"] == code or "errors" in json.loads(lean[2])
    assert _reload(worker).last_heartbeat < timezone.now() - LONG_AGO + timedelta(seconds=1)


def test_another_workers_id_is_403(full_path):
    worker = _worker()

    status, _, body = post({"worker_id": WorkerFactory().pk}, token=worker_token(worker))

    assert (status, json.loads(body)["code"]) == (403, "permission_denied")


@pytest.mark.parametrize("token", [None, "wt_not-a-token"])
def test_a_missing_or_unknown_token_is_401(full_path, token):
    clear_failed_auth_counters()

    status, _, body = post({"status": "idle"}, token=token)

    assert (status, set(json.loads(body))) == (401, {"code", "detail"})


def test_a_rotated_token_is_refused_at_the_very_next_heartbeat():
    clear_failed_auth_counters()
    worker = _worker()
    token = worker_token(worker)
    assert post({"status": "idle"}, token=token)[0] == 200

    worker_rotate_token(worker_id=worker.pk, actor=Actor.system())
    status, _, body = post({"status": "idle"}, token=token)

    assert status == 401
    assert json.loads(body) == json.loads(post_full({"status": "idle"}, token=token)[2])


def test_a_host_not_allowed_is_refused_as_before(full_path):
    worker = _worker()
    before = worker.last_heartbeat

    with override_settings(ALLOWED_HOSTS=["orchestrator.example.com"]):
        status, _, _ = post({"status": "idle"}, token=worker_token(worker))

    assert status == 400
    assert _reload(worker).last_heartbeat == before


# --- the service: one guarded UPDATE, or nothing ----------------------------------------------------


def test_the_liveness_service_writes_nothing_for_a_heartbeat_that_changes_state():
    idle_offline = _worker(offline=True)
    holding = _worker()
    held = job_on_worker(holding)
    dispatched_to = _worker()
    dispatched = job_on_worker(dispatched_to, status=JobStatus.DISPATCHED)
    JobFactory()
    cases = [
        (idle_offline, {"status": "idle"}),
        (holding, {"status": "idle"}),  # holds a job the agent does not run: reconcile
        (holding, {"current_job_id": held.pk, "progress": {"step": 1}}),
        (holding, {"current_job_id": held.pk, "log_tail": "x"}),
        (holding, {"current_job_id": held.pk, "attempt": "other"}),
        (holding, {"current_job_id": dispatched.pk}),
        (dispatched_to, {"current_job_id": dispatched.pk}),
    ]
    before = {w.pk: w.last_heartbeat for w in Worker.objects.all()}
    tokens = {w.pk: worker_token(w) for w in (idle_offline, holding, dispatched_to)}

    answers = [agents.worker_heartbeat_liveness(secret=tokens[w.pk], data=data) for w, data in cases]

    assert answers == [None] * len(cases)
    assert {w.pk: w.last_heartbeat for w in Worker.objects.all()} == before


def test_the_lean_path_marks_its_token_used_at_most_once_a_minute(full_path):
    worker = _worker()
    secret = worker_token(worker)
    token = Token.objects.get(worker=worker)
    recent, stale = timezone.now() - timedelta(seconds=10), timezone.now() - timedelta(minutes=2)

    for last_used, touched in [(None, True), (recent, False), (stale, True)]:
        Token.objects.filter(pk=token.pk).update(last_used_at=last_used)
        assert post({"status": "idle"}, token=secret)[0] == 200
        assert (_reload(token).last_used_at != last_used) is touched
    assert full_path == []


def test_an_expired_token_is_401(full_path):
    clear_failed_auth_counters()
    worker = _worker()
    secret = worker_token(worker)
    Token.objects.filter(worker=worker).update(expires_at=timezone.now() - timedelta(seconds=1))

    status, _, body = post({"status": "idle"}, token=secret)

    assert status == 401
    assert json.loads(body) == json.loads(post_full({"status": "idle"}, token=secret)[2])  # the same code
    assert _reload(worker).last_heartbeat < timezone.now() - LONG_AGO + timedelta(seconds=1)


def test_a_token_header_spelt_with_an_underscore_is_read_as_django_reads_it(full_path):
    # Django reads "x_worker_token" as X-Worker-Token and joins it with the real one: its reading decides
    worker = _worker()
    underscored = protocol.WORKER_TOKEN_HEADER.lower().replace("-", "_").encode()
    lean = post({"status": "idle"}, token=worker_token(worker), headers=[(underscored, b"wt_not-a-token")])
    full = post_full({"status": "idle"}, token=worker_token(worker), headers=[(underscored, b"wt_not-a-token")])

    assert full_path == [worker.pk, worker.pk]  # the lean path handed it to Django, as the direct call went
    assert (lean[0], lean[2]) == (full[0], full[2])


def test_disallowed_user_agents_are_checked_by_django(full_path):
    worker = _worker()
    with override_settings(DISALLOWED_USER_AGENTS=[re.compile(r"^BadBot")]):
        status, _, _ = post({"status": "idle"}, token=worker_token(worker), headers=[(b"user-agent", b"BadBot/1.0")])
    assert status == 403
    assert full_path == []


# --- batches: the heartbeats arriving while one batch is written go together in the next -----------


def _gate(monkeypatch):
    """Hold the first batch on its request thread until ``release`` is set; record each batch's workers and
    whether it ran in a transaction."""
    release, batches = threading.Event(), []
    statement, batched = agents._liveness_statement, agents.worker_heartbeats_liveness

    def gated_statement(secret, data, now):
        batches[-1]["workers"].append(data.get("worker_id"))
        batches[-1]["atomic"].append(connection.in_atomic_block)
        if len(batches) == 1:
            assert release.wait(10)
        return statement(secret, data, now)

    def gated_batch(batch):
        batches.append({"workers": [], "atomic": []})
        return batched(batch)

    monkeypatch.setattr(agents, "_liveness_statement", gated_statement)
    monkeypatch.setattr(agents, "worker_heartbeats_liveness", gated_batch)
    return release, batches


async def _storm(workers, tokens, release, batches):
    """POST one heartbeat for the first worker, then, while its batch is being written, one for each other
    worker; release the first batch once every other heartbeat waits."""

    def post_for(worker):
        return asyncio.ensure_future(_post(application, {"worker_id": worker.pk, "status": "idle"}, token=tokens[worker.pk]))

    async def until(condition):
        for _ in range(2000):
            if condition():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("timed out")

    posts = [post_for(workers[0])]
    await until(lambda: batches)  # the first batch is on its request thread, held there
    posts += [post_for(worker) for worker in workers[1:]]
    writer = application.heartbeats.writer()
    await until(lambda: len(writer.waiting) == len(workers) - 1)
    release.set()
    return await asyncio.gather(*posts)


def test_heartbeats_arriving_during_a_write_are_recorded_together_in_one_transaction_in_id_order(full_path, monkeypatch):
    workers = [_worker() for _ in range(6)]
    tokens = {w.pk: worker_token(w) for w in workers}
    before = {w.pk: w.last_heartbeat for w in workers}
    release, batches = _gate(monkeypatch)

    answers = async_to_sync(_storm)(workers, tokens, release, batches)

    assert [status for status, _, _ in answers] == [200] * 6
    assert [json.loads(body)["status"] for _, _, body in answers] == ["idle"] * 6
    assert full_path == []  # every one answered by the lean path
    first, second = batches
    assert first["workers"] == [workers[0].pk] and first["atomic"] == [False]  # alone: written at once, autocommit
    assert second["workers"] == sorted(w.pk for w in workers[1:])  # the rest together, in id order
    assert second["atomic"] == [True] * 5  # in one transaction
    assert all(_reload(w).last_heartbeat > before[w.pk] for w in workers)


def test_a_batch_holds_at_most_max_batch_heartbeats(full_path, monkeypatch):
    workers = [_worker() for _ in range(6)]
    tokens = {w.pk: worker_token(w) for w in workers}
    release, batches = _gate(monkeypatch)
    monkeypatch.setattr(LivenessWriter, "MAX_BATCH", 2)

    answers = async_to_sync(_storm)(workers, tokens, release, batches)

    assert [status for status, _, _ in answers] == [200] * 6
    assert [len(batch["workers"]) for batch in batches] == [1, 2, 2, 1]
    assert full_path == []


def test_a_batch_whose_transaction_fails_is_recorded_one_by_one_and_a_failing_heartbeat_takes_the_full_path(monkeypatch, caplog):
    workers = sorted((_worker() for _ in range(3)), key=lambda w: w.pk)
    failing = workers[1]
    tokens = {w.pk: worker_token(w) for w in workers}
    before = {w.pk: w.last_heartbeat for w in workers}
    original = agents._liveness_statement
    calls = []

    def statement(secret, data, now):
        calls.append((data["worker_id"], connection.in_atomic_block))
        if data["worker_id"] == failing.pk:
            raise OperationalError("could not serialize access")
        return original(secret, data, now)

    monkeypatch.setattr(agents, "_liveness_statement", statement)
    batch = [(tokens[w.pk], {"worker_id": w.pk, "status": "idle"}) for w in reversed(workers)]

    answers = agents.worker_heartbeats_liveness(batch)

    assert [answer and answer["status"] for answer in answers] == ["idle", None, "idle"]
    ids = [w.pk for w in workers]
    assert calls == [(ids[0], True), (ids[1], True)] + [(pk, False) for pk in reversed(ids)]  # together, then each
    assert _reload(failing).last_heartbeat == before[failing.pk]
    assert all(_reload(w).last_heartbeat > before[w.pk] for w in workers if w is not failing)
    assert "3 heartbeats could not be recorded together (could not serialize access)" in caplog.text


def test_a_heartbeat_the_lean_path_cannot_record_is_answered_by_the_full_path(full_path, monkeypatch):
    worker = _worker()

    def broken(batch):
        raise OperationalError("server closed the connection unexpectedly")

    monkeypatch.setattr(agents, "worker_heartbeats_liveness", broken)  # the lean path's batch write
    status, _, body = post({"worker_id": worker.pk, "status": "idle"}, token=worker_token(worker))

    assert (status, json.loads(body)["status"]) == (200, "idle")
    assert full_path == [worker.pk]


def test_a_batch_is_one_update_per_heartbeat_and_one_for_the_tokens_due_to_be_marked_used():
    workers = [_worker() for _ in range(3)]
    tokens = {w.pk: worker_token(w) for w in workers}
    Token.objects.filter(worker=workers[2]).update(last_used_at=timezone.now())  # used just now: not due
    batch = [(tokens[w.pk], {"worker_id": w.pk, "status": "idle"}) for w in workers]

    with CaptureQueriesContext(connection) as queries:
        answers = agents.worker_heartbeats_liveness(batch)

    assert [answer["status"] for answer in answers] == ["idle"] * 3
    writes = [q["sql"] for q in queries.captured_queries if q["sql"].startswith("UPDATE")]
    assert [sql.split()[1] for sql in writes] == ['"workers_worker"'] * 3 + ['"workers_token"']
    touched = Token.objects.filter(worker__in=workers[:2])
    assert touched.count() == 2 and all(token.last_used_at is not None for token in touched)


@pytest.mark.parametrize("fast_paths", [True, False])
def test_one_rule_decides_a_heartbeat_that_changes_nothing_on_either_route(monkeypatch, fast_paths):
    """Through the fast path or Django's own handler, a plain heartbeat is recorded by the liveness rule (and
    nothing else), and one that changes state is not."""
    from django.core.handlers.asgi import ASGIHandler

    from serving.asgi import FastPathsASGIHandler

    recorded, rule = [], agents._record_liveness

    def spy(batch, *, now):
        answers = rule(batch, now=now)
        recorded.extend(answer is not None for answer in answers)
        return answers

    monkeypatch.setattr(agents, "_record_liveness", spy)
    app = FastPathsASGIHandler() if fast_paths else ASGIHandler()
    plain, offline = _worker(), _worker(status=WorkerStatus.OFFLINE)
    rows = AuditEvent.objects.count()

    assert async_to_sync(_post)(app, {"status": "idle"}, token=worker_token(plain))[0] == 200
    assert recorded == [True] and AuditEvent.objects.count() == rows
    recorded.clear()
    assert async_to_sync(_post)(app, {"status": "idle"}, token=worker_token(offline))[0] == 200
    assert recorded and not any(recorded)  # refused by the rule: the full path brought the worker back
    assert _reload(offline).status != WorkerStatus.OFFLINE


def test_a_validate_added_to_the_heartbeat_serializer_holds_on_the_lean_path_too(full_path, monkeypatch):
    """The lean path runs the serializer's own validation, ``validate`` included: a rule added there is not
    skipped (the heartbeat goes to the full path, which refuses it the same way)."""
    from rest_framework import serializers

    from workers.api.serializers import HeartbeatSerializer

    def no_cpu_over_100(self, attrs):
        if attrs.get("cpu_percent", 0) > 100:
            raise serializers.ValidationError({"cpu_percent": "at most 100"})
        return attrs

    monkeypatch.setattr(HeartbeatSerializer, "validate", no_cpu_over_100)
    worker = _worker()
    token = worker_token(worker)

    assert post({"status": "idle", "cpu_percent": 50}, token=token)[0] == 200
    assert full_path == []  # answered by the lean path
    before = _reload(worker).last_heartbeat
    status, _, body = post({"status": "idle", "cpu_percent": 150}, token=token)
    assert (status, json.loads(body)["code"]) == (400, "invalid")  # HeartbeatView's answer, before any service
    assert full_path == [] and _reload(worker).last_heartbeat == before  # nothing recorded by either path


def test_an_unknown_field_is_refused_alike_with_the_fast_paths_on_and_off(full_path):
    """The lean path (fast paths on) and Django's own handler (SIMPLETUNER_FAST_PATHS=off) answer a field the
    heartbeat does not take with the same 400 naming it, and record nothing."""
    from django.core.handlers.asgi import ASGIHandler

    from serving.asgi import FastPathsASGIHandler

    worker = _worker()
    token = worker_token(worker)
    before = _reload(worker).last_heartbeat
    body = {"worker_id": worker.pk, "status": "idle", "current_job_id": None, "cpu_percnt": 3}

    on = async_to_sync(_post)(FastPathsASGIHandler(), body, token=token)
    off = async_to_sync(_post)(ASGIHandler(), body, token=token)

    assert on == off
    status, _, answer = on
    assert status == 400
    assert json.loads(answer)["errors"]["cpu_percnt"] == [
        "Unknown field: this endpoint takes " + ", ".join(HeartbeatSerializer().fields) + ". Did you mean cpu_percent?"
    ]
    assert _reload(worker).last_heartbeat == before
    assert AuditEvent.objects.count() == 0


def test_a_heartbeat_with_an_unknown_field_builds_no_validator_and_leaves_the_cache_as_it_was(full_path, monkeypatch):
    """Any number of shapes with unknown names: each refused before a validator is looked up, so the cache of
    validators (one per shape of heartbeat taken) neither grows nor loses the shapes in use."""
    from serving import heartbeat

    worker = _worker()
    token = worker_token(worker)
    assert post({"status": "idle"}, token=token)[0] == 200
    cached = heartbeat._validator.cache_info()
    built = []
    monkeypatch.setattr(heartbeat, "HeartbeatSerializer", lambda *a, **k: built.append(1))

    answers = {post({"status": "idle", f"field_{n}": n}, token=token)[0] for n in range(100)}

    assert answers == {400}
    assert heartbeat._validator.cache_info() == cached and built == []
    assert post({"status": "idle"}, token=token)[0] == 200
    assert heartbeat._validator.cache_info().hits == cached.hits + 1
