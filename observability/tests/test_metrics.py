"""GET /metrics: fleet and queue state from the database, event counters moved by the real services, access modes."""

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client.parser import text_string_to_metric_families

from audit.sweeps import seal_chain
from audit.tests.factories import AuditEventFactory
from job_queue.models import Job, JobStatus
from job_queue.dispatch import dispatch_for_job
from job_queue.sweeps import sweep_stale_workers, sweep_unacknowledged_dispatches
from job_queue.tests.factories import JobAttemptFactory, JobFactory, job_on_worker
from workers.models import Worker, WorkerStatus, WorkerType
from workers.tests.factories import UserFactory, WorkerFactory

pytestmark = pytest.mark.django_db

REPO_ROOT = Path(__file__).resolve().parents[2]
REQUEUES = "simpletuner_job_requeues_total"
EXHAUSTED = "simpletuner_job_retries_exhausted_total"
QUEUE_WAIT = "simpletuner_job_queue_wait_seconds"
LATENCY = "simpletuner_job_dispatch_latency_seconds"


def parse(text):
    """Return ``{(sample name, ((label, value), ...)): value}`` from a Prometheus text exposition."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples, name, **labels):
    return samples[name, tuple(sorted(labels.items()))]


def ago(seconds):
    return timezone.now() - timedelta(seconds=seconds)


def run_python(code, env):
    """Run ``python -c code`` in the repository with ``env``; return the completed process (output captured)."""
    return subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120, check=False
    )


@pytest.fixture
def access(settings):
    """``access("public")`` sets SIMPLETUNER_METRICS for the test."""

    def _set(mode):
        settings.SIMPLETUNER = {**settings.SIMPLETUNER, "METRICS": mode}

    return _set


@pytest.fixture
def scrape(access, api_client):
    """``scrape()``: GET /metrics (public access) and return its parsed samples."""
    access("public")

    def _scrape():
        response = api_client.get("/metrics")
        assert response.status_code == 200, response.content
        assert response["Content-Type"].startswith("text/plain; version=0.0.4")
        return parse(response.content.decode())

    return _scrape


# --- state read from the database -----------------------------------------------------------------


def test_workers_by_status_and_type_every_combination_zeros_included(scrape):
    WorkerFactory.create_batch(2)
    job_on_worker(WorkerFactory(worker_type=WorkerType.EPHEMERAL))
    WorkerFactory(offline=True)
    WorkerFactory(fresh=True)
    WorkerFactory(draining=True, worker_type=WorkerType.LOCAL)

    samples = scrape()

    expected = {(s, t): 0 for s in WorkerStatus.values for t in WorkerType.values}
    expected |= {
        ("idle", "persistent"): 2,
        ("busy", "ephemeral"): 1,
        ("offline", "persistent"): 1,
        ("connecting", "persistent"): 1,
        ("draining", "local"): 1,
    }
    exported = {
        (dict(labels)["status"], dict(labels)["type"]): n
        for (name, labels), n in samples.items()
        if name == "simpletuner_workers"
    }
    assert exported == expected


def test_jobs_by_status_every_status_zeros_included(scrape):
    JobFactory.create_batch(3)
    JobFactory(status=JobStatus.COMPLETED)
    job_on_worker(WorkerFactory(), status=JobStatus.RUNNING)
    job_on_worker(WorkerFactory(), status=JobStatus.DISPATCHED)

    samples = scrape()

    assert {status: value(samples, "simpletuner_jobs", status=status) for status in JobStatus.values} == {
        "queued": 3,
        "dispatched": 1,
        "running": 1,
        "completed": 1,
        "failed": 0,
        "cancelled": 0,
    }


def test_heartbeat_age_per_online_status_and_late_workers(scrape, settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "HEARTBEAT_INTERVAL": 30}  # late after 60 s
    WorkerFactory(last_heartbeat=ago(100))  # idle, late
    WorkerFactory(last_heartbeat=ago(5))
    job_on_worker(WorkerFactory(last_heartbeat=ago(40)))  # busy, not late yet
    WorkerFactory(offline=True, last_heartbeat=ago(10_000))  # offline: neither age nor late
    WorkerFactory(fresh=True)

    samples = scrape()

    age = {s: value(samples, "simpletuner_worker_heartbeat_age_max_seconds", status=s) for s in ("idle", "busy", "draining")}
    assert 100 <= age["idle"] < 110
    assert 40 <= age["busy"] < 50
    assert age["draining"] == 0
    assert value(samples, "simpletuner_workers_heartbeat_late") == 1


def test_streams_open_counts_workers_with_a_stream_on_any_process(scrape):
    WorkerFactory.create_batch(3)
    WorkerFactory(offline=True)
    WorkerFactory(fresh=True)
    Worker.objects.filter(pk=WorkerFactory().pk).update(stream_id=None)

    assert value(scrape(), "simpletuner_worker_streams_open") == 3


def test_oldest_queued_age_counts_a_requeued_job_from_its_last_attempt(scrape):
    assert value(scrape(), "simpletuner_jobs_queued_oldest_age_seconds") == 0
    # Submitted 5 h ago, ran, lost its worker 60 s ago: it has waited 60 s, not 5 h.
    requeued = JobFactory(submitted_at=ago(5 * 3600), attempt_count=1, retry_count=1)
    JobAttemptFactory(job=requeued, worker=None, number=1, dispatched_at=ago(4 * 3600), finished_at=ago(60), outcome="lost")
    JobFactory(status=JobStatus.COMPLETED, submitted_at=ago(86_400))

    assert 60 <= value(scrape(), "simpletuner_jobs_queued_oldest_age_seconds") < 70

    JobFactory(submitted_at=ago(600))
    assert 600 <= value(scrape(), "simpletuner_jobs_queued_oldest_age_seconds") < 610


def test_audit_rows_not_sealed_yet_are_counted_with_the_age_of_the_oldest(scrape):
    samples = scrape()
    assert value(samples, "simpletuner_audit_unsealed_rows") == 0
    assert value(samples, "simpletuner_audit_unsealed_oldest_age_seconds") == 0
    AuditEventFactory(created_at=ago(90))
    AuditEventFactory()
    samples = scrape()
    assert value(samples, "simpletuner_audit_unsealed_rows") == 2
    assert 90 <= value(samples, "simpletuner_audit_unsealed_oldest_age_seconds") < 100
    seal_chain()
    samples = scrape()
    assert value(samples, "simpletuner_audit_unsealed_rows") == 0
    assert value(samples, "simpletuner_audit_unsealed_oldest_age_seconds") == 0


def test_scrape_cost_does_not_grow_with_workers_and_jobs(scrape, django_assert_max_num_queries):
    WorkerFactory()
    JobFactory()
    with CaptureQueriesContext(connection) as few:
        scrape()
    assert len(few) == 5  # workers, jobs, oldest queued job, GPU-seconds by team and user, audit rows not sealed yet

    for _ in range(20):
        job_on_worker(WorkerFactory(last_heartbeat=ago(500)), status=JobStatus.RUNNING)
        requeued = JobFactory(attempt_count=1)
        JobAttemptFactory(job=requeued, worker=None, finished_at=ago(30), outcome="lost")
    WorkerFactory.create_batch(20, offline=True)
    JobFactory.create_batch(20, status=JobStatus.COMPLETED)
    with django_assert_max_num_queries(len(few)):
        samples = scrape()
    assert value(samples, "simpletuner_jobs", status="queued") == 21


# --- events counted by the services, on commit ----------------------------------------------------


def test_submit_and_dispatch_observe_the_queue_wait(scrape, commit, operator_client):
    WorkerFactory()
    before = scrape()

    with commit():
        response = operator_client.post("/api/queue/submit", {"config_name": "cfg"})
    assert response.json()["dispatched"] is True

    after = scrape()
    assert value(after, f"{QUEUE_WAIT}_count") - value(before, f"{QUEUE_WAIT}_count") == 1
    assert value(after, f"{QUEUE_WAIT}_bucket", le="1.0") - value(before, f"{QUEUE_WAIT}_bucket", le="1.0") == 1


def test_a_job_queued_200_s_ago_lands_in_the_300_s_bucket(scrape, commit):
    job = JobFactory(submitted_at=ago(200))
    WorkerFactory()
    before = scrape()

    with commit():
        assert dispatch_for_job(job.pk) is not None

    after = scrape()

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta(f"{QUEUE_WAIT}_bucket", le="120.0") == 0
    assert delta(f"{QUEUE_WAIT}_bucket", le="300.0") == 1
    assert 200 <= delta(f"{QUEUE_WAIT}_sum") < 210


def test_acknowledgement_observes_the_dispatch_latency(scrape, commit, worker_client):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.DISPATCHED)
    Job.objects.filter(pk=job.pk).update(dispatched_at=ago(3))
    before = scrape()

    with commit():
        response = worker_client(worker).post(
            f"/api/workers/job/{job.pk}/status", {"status": "running", "attempt": job.lease_id}
        )
    assert response.status_code == 200, response.content

    after = scrape()
    assert value(after, f"{LATENCY}_bucket", le="2.5") == value(before, f"{LATENCY}_bucket", le="2.5")
    assert value(after, f"{LATENCY}_bucket", le="5.0") - value(before, f"{LATENCY}_bucket", le="5.0") == 1
    assert 3 <= value(after, f"{LATENCY}_sum") - value(before, f"{LATENCY}_sum") < 4

    # Further reports of the running job are not acknowledgements.
    with commit():
        worker_client(worker).post(f"/api/workers/job/{job.pk}/status", {"status": "running", "attempt": job.lease_id})
    assert value(scrape(), f"{LATENCY}_count") == value(after, f"{LATENCY}_count")


def test_health_sweep_counts_requeues_by_retry_spent_and_retries_exhausted(scrape, commit):
    stale = {"last_heartbeat": ago(600)}
    lost = job_on_worker(WorkerFactory(**stale), status=JobStatus.RUNNING, submitted_at=ago(5 * 3600))
    job_on_worker(WorkerFactory(**stale), status=JobStatus.DISPATCHED)
    job_on_worker(WorkerFactory(**stale), status=JobStatus.RUNNING, retry_count=3, max_retries=3)
    spare = WorkerFactory()
    before = scrape()

    with commit():
        assert sweep_stale_workers() == {"workers": 3, "requeued": 2, "failed": 1}

    after = scrape()
    assert value(after, REQUEUES, retry_spent="true") - value(before, REQUEUES, retry_spent="true") == 1
    assert value(after, REQUEUES, retry_spent="false") - value(before, REQUEUES, retry_spent="false") == 1
    assert value(after, EXHAUSTED) - value(before, EXHAUSTED) == 1
    # The sweep's dispatch on commit gave the lost job to the spare worker: it waited since its attempt
    # was lost (under a second), not since it was submitted 5 h ago.
    lost.refresh_from_db()
    assert (lost.status, lost.worker_id, lost.attempt_count) == (JobStatus.DISPATCHED, spare.pk, 2)
    assert value(after, f"{QUEUE_WAIT}_bucket", le="1.0") - value(before, f"{QUEUE_WAIT}_bucket", le="1.0") == 1
    assert value(after, f"{QUEUE_WAIT}_count") - value(before, f"{QUEUE_WAIT}_count") == 1


def test_unacknowledged_dispatch_sweep_counts_requeues_without_a_retry(scrape, commit):
    jobs = [job_on_worker(WorkerFactory(), status=JobStatus.DISPATCHED) for _ in range(2)]
    Job.objects.filter(pk__in=[j.pk for j in jobs]).update(dispatched_at=ago(3600))
    before = scrape()

    with commit():
        assert sweep_unacknowledged_dispatches()["jobs"] == 2

    after = scrape()
    assert value(after, REQUEUES, retry_spent="false") - value(before, REQUEUES, retry_spent="false") == 2
    assert value(after, REQUEUES, retry_spent="true") == value(before, REQUEUES, retry_spent="true")


def test_reported_failures_count_a_retry_then_retries_exhausted(scrape, commit, worker_client):
    worker = WorkerFactory()
    job = job_on_worker(worker, status=JobStatus.RUNNING, retry_on_failure=True, retry_count=2, max_retries=3)
    before = scrape()

    with commit():
        worker_client(worker).post(f"/api/workers/job/{job.pk}/status", {"status": "failed", "attempt": job.lease_id})
    middle = scrape()
    assert value(middle, REQUEUES, retry_spent="true") - value(before, REQUEUES, retry_spent="true") == 1
    assert value(middle, EXHAUSTED) == value(before, EXHAUSTED)

    job.refresh_from_db()  # dispatched again, to the same (now idle) worker
    assert (job.status, job.worker_id, job.retry_count) == (JobStatus.DISPATCHED, worker.pk, 3)
    with commit():
        worker_client(worker).post(f"/api/workers/job/{job.pk}/status", {"status": "failed", "attempt": job.lease_id})
    after = scrape()
    assert value(after, EXHAUSTED) - value(middle, EXHAUSTED) == 1
    assert value(after, REQUEUES, retry_spent="true") == value(middle, REQUEUES, retry_spent="true")
    assert Job.objects.get(pk=job.pk).status == JobStatus.FAILED


def test_nothing_is_counted_when_the_transaction_rolls_back(scrape, commit):
    job_on_worker(WorkerFactory(last_heartbeat=ago(600)), status=JobStatus.RUNNING)
    job_on_worker(WorkerFactory(last_heartbeat=ago(600)), status=JobStatus.RUNNING, retry_count=3, max_retries=3)
    queued = JobFactory(submitted_at=ago(60))
    before = scrape()

    with commit(), pytest.raises(RuntimeError), transaction.atomic():
        assert sweep_stale_workers()["requeued"] == 1
        WorkerFactory()
        assert dispatch_for_job(queued.pk) is not None
        raise RuntimeError("rolled back")

    after = scrape()
    assert Job.objects.get(pk=queued.pk).status == JobStatus.QUEUED
    for name, labels in ((REQUEUES, {"retry_spent": "true"}), (EXHAUSTED, {}), (f"{QUEUE_WAIT}_count", {})):
        assert value(after, name, **labels) == value(before, name, **labels), name

    # The same work committed is counted.
    with commit():
        sweep_stale_workers()
    assert value(scrape(), REQUEUES, retry_spent="true") - value(before, REQUEUES, retry_spent="true") == 1


def test_nothing_is_counted_before_commit(scrape, django_capture_on_commit_callbacks):
    job_on_worker(WorkerFactory(last_heartbeat=ago(600)), status=JobStatus.RUNNING)
    before = scrape()
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        sweep_stale_workers()
    assert value(scrape(), REQUEUES, retry_spent="true") == value(before, REQUEUES, retry_spent="true")
    for callback in callbacks:
        callback()
    assert value(scrape(), REQUEUES, retry_spent="true") - value(before, REQUEUES, retry_spent="true") == 1


# --- several processes ----------------------------------------------------------------------------

COUNTING_PROCESS = """
import datetime, django
django.setup()
from common import outbox
from job_queue import events
outbox.emit(events.REQUEUED, count={requeued}, retry_spent=True)
outbox.emit(events.RETRIES_EXHAUSTED, count=1)
t = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
outbox.emit(events.ACKNOWLEDGED, dispatched_at=t, started_at=t + datetime.timedelta(seconds=0.2))
"""


def test_multiprocess_mode_sums_every_process_and_adds_the_database_state(tmp_path, monkeypatch, scrape):
    multiproc = tmp_path / "prometheus"
    multiproc.mkdir()
    env = {
        **os.environ,
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        "SIMPLETUNER_DATA_DIR": str(tmp_path / "data"),
        "DJANGO_SETTINGS_MODULE": "simpletuner_site.settings",
    }
    env.pop("DATABASE_URL", None)
    env.pop("REDIS_URL", None)
    for requeued in (2, 3):  # two orchestrator processes (say a server and the Celery worker)
        counted = run_python(COUNTING_PROCESS.format(requeued=requeued), env)
        assert counted.returncode == 0, counted.stderr
    assert len(list(multiproc.glob("counter_*.db"))) == 2
    WorkerFactory.create_batch(2)

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(multiproc))
    samples = scrape()

    assert value(samples, REQUEUES, retry_spent="true") == 5
    assert value(samples, REQUEUES, retry_spent="false") == 0
    assert value(samples, EXHAUSTED) == 2
    assert value(samples, f"{LATENCY}_count") == 2
    assert value(samples, f"{LATENCY}_bucket", le="0.1") == 0
    assert value(samples, f"{LATENCY}_bucket", le="0.25") == 2
    assert value(samples, "simpletuner_workers", status="idle", type="persistent") == 2


@pytest.mark.parametrize(
    ("variable", "raw", "message"),
    [
        ("SIMPLETUNER_METRICS", "everyone", "SIMPLETUNER_METRICS must be one of operators, public, off"),
        ("PROMETHEUS_MULTIPROC_DIR", "/nonexistent/prometheus", "PROMETHEUS_MULTIPROC_DIR must be an existing directory"),
    ],
)
def test_a_bad_setting_stops_start_up(tmp_path, variable, raw, message):
    result = run_python("import simpletuner_site.settings", {**os.environ, "SIMPLETUNER_DATA_DIR": str(tmp_path), variable: raw})
    assert result.returncode != 0
    assert f"ImproperlyConfigured: {message}" in result.stderr


# --- who may read it ------------------------------------------------------------------------------


def test_operators_by_default_anonymous_is_401_json(settings, api_client):
    assert settings.SIMPLETUNER["METRICS"] == "operators"
    response = api_client.get("/metrics")
    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"
    assert response["WWW-Authenticate"] == "Bearer"


def test_operators_mode_accepts_an_api_token_and_a_session(access, bearer_client, client):
    access("operators")
    user = UserFactory()
    WorkerFactory()

    by_token = bearer_client(user).get("/metrics", HTTP_ACCEPT="text/plain")
    client.force_login(user)
    by_session = client.get("/metrics")

    for response in (by_token, by_session):
        assert response.status_code == 200
        assert value(parse(response.content.decode()), "simpletuner_workers", status="idle", type="persistent") == 1


def test_operators_mode_refuses_a_worker_token_and_a_bad_api_token(access, worker_client, api_client):
    access("operators")
    assert worker_client(WorkerFactory()).get("/metrics").status_code == 401
    api_client.credentials(HTTP_AUTHORIZATION="Bearer sta_not-a-token")
    response = api_client.get("/metrics")
    assert (response.status_code, response.json()["code"]) == (401, "not_authenticated")


def test_public_mode_needs_no_credentials_and_ignores_them(access, api_client):
    access("public")
    assert api_client.get("/metrics").status_code == 200
    api_client.credentials(HTTP_AUTHORIZATION="Bearer sta_not-a-token")
    assert api_client.get("/metrics").status_code == 200


def test_openmetrics_is_served_to_a_client_that_asks_for_it(scrape, api_client):
    response = api_client.get("/metrics", HTTP_ACCEPT="application/openmetrics-text; version=1.0.0")
    assert response.status_code == 200
    assert response["Content-Type"].startswith("application/openmetrics-text; version=1.0.0")
    assert response.content.rstrip().endswith(b"# EOF")


def test_off_is_a_json_404_even_for_an_operator(access, operator_client):
    access("off")
    response = operator_client.get("/metrics")
    assert response.status_code == 404
    assert response.json() == {"code": "not_found", "detail": "metrics are turned off (SIMPLETUNER_METRICS=off)"}
