"""Signed webhooks against a real HTTP receiver on loopback: real orchestrator processes (``simpletuner server``
with its embedded scheduler on SQLite; daphne beside a Celery worker with beat on PostgreSQL + Redis) and a real
agent. The receiver checks every signature; deliveries are retried with the same id, not retried on a 404,
survive an orchestrator killed -9, never come from a rolled-back change, and arrive in order for one job.
"""

import hashlib
import hmac
import json
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psutil
import pytest

from ..services import require_postgres_url, require_redis_url
from .agent_harness import AgentRunner, write_import_blocker
from .harness import REPO_ROOT, Fleet, Orchestrator, create_database, drop_database, expect, poll

pytestmark = pytest.mark.e2e

SECRET = "e2e-webhook-secret-" + secrets.token_hex(8)
DELIVERY_DEADLINE_S = 10  # the first attempt, after the commit
RETRY_DEADLINE_S = 45  # a retry (10-15 s backoff, 5 s sweep), or a lease left by a killed sender (30 s)
QUICK_JOB = {"max_train_steps": 5, "step_delay": 0.05}


class Receiver:
    """A real HTTP server on 127.0.0.1. Each path answers the codes queued for it (``plan``), then 200; ``"hang"``
    holds the request unanswered until ``release()``. Every request is recorded with its signature's verdict."""

    def __init__(self, secret=SECRET):
        self.requests = []
        self.plan = {}
        self.lock = threading.Lock()
        self.released = threading.Event()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
                with receiver.lock:
                    receiver.requests.append(
                        {
                            "path": self.path,
                            "headers": dict(self.headers),
                            "body": json.loads(body),
                            "signed": hmac.compare_digest(expected, self.headers.get("X-SimpleTuner-Signature", "")),
                            "at": time.time(),
                        }
                    )
                    queued = receiver.plan.get(self.path) or []
                    answer = queued.pop(0) if queued else 200
                if answer == "hang":
                    receiver.released.wait(60)
                    self.close_connection = True
                    return
                self.send_response(answer)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def start(self):
        self.thread.start()
        return self

    def url(self, path):
        return f"http://127.0.0.1:{self.server.server_address[1]}{path}"

    def release(self):
        self.released.set()

    def stop(self):
        self.release()
        self.server.shutdown()
        self.server.server_close()

    def seen(self, path=None, **where):
        """The requests to ``path`` (all paths: None) whose body's data has ``where``'s values (``event`` is the body's)."""
        with self.lock:
            found = list(self.requests)
        return [
            r for r in found
            if (path is None or r["path"] == path)
            and all((r["body"].get(k) if k == "event" else r["body"]["data"].get(k)) == v for k, v in where.items())
        ]  # fmt: skip

    def wait(self, path, count=1, *, timeout=DELIVERY_DEADLINE_S, **where):
        return poll(lambda: len(self.seen(path, **where)) >= count and self.seen(path, **where), timeout=timeout, interval=0.05,
                    message=f"{count} request(s) to {path} with {where}")  # fmt: skip


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
    ],
)
def server(request, tmp_path_factory):
    """An orchestrator whose sweeps run (the embedded scheduler, or Celery beat), allowed to call loopback receivers."""
    env = {"SIMPLETUNER_WEBHOOK_ALLOW_PRIVATE": "true"}
    server_url = database_url = redis_url = None
    if request.param == "postgres":
        server_url, redis_url = require_postgres_url(), require_redis_url()
        database_url = create_database(server_url)
    data_dir = tmp_path_factory.mktemp(f"webhooks-{request.param}")
    orchestrator = Orchestrator(
        backend=request.param, data_dir=data_dir, database_url=database_url, redis_url=redis_url,
        via_cli=request.param == "sqlite", celery=request.param == "postgres", extra_env=env,
    )  # fmt: skip
    try:
        yield orchestrator.start()
    finally:
        orchestrator.stop()
        if database_url:
            drop_database(server_url, database_url)


@pytest.fixture
def receiver():
    running = Receiver().start()
    yield running
    running.stop()


def make_webhook(server, receiver, path, events):
    body = {"url": receiver.url(path), "events": events, "secret": SECRET}
    return expect(server.admin("POST", "/api/admin/webhooks", json=body), 201)


def deliveries(server, hook):
    return expect(server.admin("GET", f"/api/admin/webhooks/{hook['id']}/deliveries"), 200)["results"]


def queued_job(server):
    """A job no worker can take (it stays queued until cancelled)."""
    body = {"config_name": "e2e-webhooks", "worker_labels": {"pool": "nobody-" + secrets.token_hex(4)}}
    return expect(server.admin("POST", "/api/queue/submit", json=body), 201)["job_id"]


def cancel(server, job_id):
    expect(server.admin("POST", f"/api/queue/{job_id}/cancel", json={}), 200)


def run_django(server, code, *, expect_kill=False):
    """Run ``code`` in a ``manage.py shell`` process of ``server``'s own (its database, its settings)."""
    result = subprocess.run(
        [sys.executable, "manage.py", "shell", "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT, env=server.env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    if expect_kill:
        assert result.returncode == -signal.SIGKILL, (result.returncode, result.stdout, result.stderr)
    else:
        assert result.returncode == 0, (result.stdout, result.stderr)
    return result.stdout


def kill_all(server):
    """SIGKILL the orchestrator: its server process and, with Celery, its worker and beat."""
    celery, server.celery_process = server.celery_process, None
    if celery is not None:
        for process in [*psutil.Process(celery.pid).children(recursive=True), psutil.Process(celery.pid)]:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        celery.wait(timeout=10)
    server.kill()


def test_a_job_run_by_a_real_agent_is_delivered_signed_within_seconds_of_its_commit(server, receiver, tmp_path):
    hook = make_webhook(server, receiver, "/done", ["job.completed", "worker.offline"])
    fleet = Fleet(server, "webhooks")
    agents = AgentRunner(server, fleet, tmp_path, blocker_dir=write_import_blocker(tmp_path / "blocker"))
    try:
        worker = fleet.create_worker(labels={"pool": fleet.tag})
        agent = agents.start(worker)
        agents.wait_ready(agent)
        job_id = agents.submit(labels={"pool": fleet.tag}, config=QUICK_JOB)["job_id"]

        (request,) = receiver.wait("/done", event="job.completed", id=job_id, timeout=60)
        job = server.job(job_id)
        assert job["status"] == "completed"
        assert request["signed"], request["headers"]
        body, headers = request["body"], request["headers"]
        assert set(body) == {"id", "event", "occurred_at", "data"} and body["data"]["status"] == "completed"
        assert headers["X-SimpleTuner-Event"] == "job.completed" and headers["X-SimpleTuner-Delivery"] == body["id"]
        assert headers["Content-Type"] == "application/json"
        finished = datetime.fromisoformat(job["finished_at"].replace("Z", "+00:00")).timestamp()
        assert request["at"] - finished < DELIVERY_DEADLINE_S

        agent.terminate()  # its goodbye takes the worker offline
        agent.wait_exit()
        (offline,) = receiver.wait("/done", event="worker.offline", id=worker.id)
        assert offline["signed"] and offline["body"]["data"]["status"] == "offline"
        assert {d["status"] for d in deliveries(server, hook)} == {"delivered"}
    finally:
        agents.cleanup()
        fleet.cleanup()


def test_a_500_is_retried_with_the_same_delivery_id_and_a_404_is_not(server, receiver):
    receiver.plan = {"/flaky": [500], "/gone": [404]}
    flaky = make_webhook(server, receiver, "/flaky", ["job.cancelled"])
    gone = make_webhook(server, receiver, "/gone", ["job.cancelled"])
    job_id = queued_job(server)

    cancel(server, job_id)

    first, second = receiver.wait("/flaky", 2, id=job_id, timeout=RETRY_DEADLINE_S)
    assert first["headers"]["X-SimpleTuner-Delivery"] == second["headers"]["X-SimpleTuner-Delivery"] == first["body"]["id"]
    assert first["body"] == second["body"] and first["signed"] and second["signed"]
    assert 9 < second["at"] - first["at"] < 30  # the first retry: 10-15 s of backoff, then at most a 5 s sweep
    (delivered,) = poll(lambda: [d for d in deliveries(server, flaky) if d["status"] == "delivered"], timeout=10)
    assert [a["status_code"] for a in delivered["attempt_history"]] == [500, 200]

    assert len(receiver.seen("/gone", id=job_id)) == 1  # the 404 was heard before the 500's retry came, and not again
    (refused,) = deliveries(server, gone)
    assert (refused["status"], refused["attempts"], refused["last_status_code"]) == ("failed", 1, 404)


def test_an_orchestrator_killed_during_a_delivery_delivers_it_after_restart(server, receiver):
    receiver.plan = {"/slow": ["hang"]}
    hook = make_webhook(server, receiver, "/slow", ["job.cancelled"])
    job_id = queued_job(server)
    cancel(server, job_id)
    (held,) = receiver.wait("/slow", id=job_id)  # the attempt is in flight, unanswered

    kill_all(server)
    receiver.release()
    server.restart()
    if server.celery:
        server._spawn_celery()

    first, again = receiver.wait("/slow", 2, id=job_id, timeout=RETRY_DEADLINE_S + 15)
    assert again["headers"]["X-SimpleTuner-Delivery"] == held["headers"]["X-SimpleTuner-Delivery"] and again["signed"]
    (delivery,) = poll(lambda: [d for d in deliveries(server, hook) if d["status"] == "delivered"], timeout=10)
    assert delivery["id"] == held["body"]["id"]


def test_a_change_whose_process_is_killed_right_after_its_commit_is_delivered_and_a_rolled_back_one_is_not(server, receiver):
    hook = make_webhook(server, receiver, "/durable", ["job.cancelled"])
    rolled_back, killed = queued_job(server), queued_job(server)

    run_django(server, f"""
        from django.db import transaction
        from audit.services import Actor
        from job_queue.services import job_cancel
        try:
            with transaction.atomic():
                job_cancel(job_id="{rolled_back}", actor=Actor.system("e2e"))
                raise RuntimeError("the change rolls back")
        except RuntimeError:
            pass
    """)
    run_django(server, f"""
        import os, signal
        from audit.services import Actor
        from job_queue.services import job_cancel
        from webhooks.sender import SENDER
        SENDER.enabled = False  # this process dies before its own sender could send anything
        job_cancel(job_id="{killed}", actor=Actor.system("e2e"))
        os.kill(os.getpid(), signal.SIGKILL)
    """, expect_kill=True)  # fmt: skip

    (request,) = receiver.wait("/durable", id=killed, timeout=RETRY_DEADLINE_S)  # sent by the orchestrator's sweep
    assert request["signed"] and request["body"]["data"]["status"] == "cancelled"
    assert server.job(rolled_back)["status"] == "queued"
    assert [d["subject"] for d in deliveries(server, hook)] == [f"job:{killed}"]
    assert receiver.seen("/durable", id=rolled_back) == []


def test_one_jobs_deliveries_arrive_in_the_order_they_happened(server, receiver):
    """A job requeued (its worker gone) and then cancelled: the requeue's delivery fails once, and the
    cancellation's waits for its retry instead of overtaking it."""
    receiver.plan = {"/ordered": [503]}
    make_webhook(server, receiver, "/ordered", ["job.requeued", "job.cancelled"])
    fleet = Fleet(server, "webhook-order")
    try:
        worker = fleet.create_worker(labels={"pool": fleet.tag})
        worker.register()
        fleet.open_stream(worker)
        job_id = fleet.submit({"config_name": "e2e-order", "worker_labels": {"pool": fleet.tag}})["job_id"]
        poll(lambda: server.job(job_id)["status"] == "dispatched", timeout=10, message="the dispatch")
        worker.report(job_id, "running", attempt=server.job(job_id)["attempts"][0]["lease_id"])
        worker.disconnect()  # the running job goes back to the queue
        poll(lambda: server.job(job_id)["status"] == "queued", timeout=10, message="the requeue")
        cancel(server, job_id)

        seen = receiver.wait("/ordered", 3, id=job_id, timeout=RETRY_DEADLINE_S)
        assert [(r["body"]["event"], r["body"]["data"]["status"]) for r in seen] == [
            ("job.requeued", "queued"),  # answered 503
            ("job.requeued", "queued"),  # its retry
            ("job.cancelled", "cancelled"),  # only then
        ]
        assert all(r["signed"] for r in seen)
    finally:
        fleet.cleanup()
