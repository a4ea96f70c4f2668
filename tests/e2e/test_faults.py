"""Failures end to end: killed agents, a killed orchestrator, a network partition and a lost dispatch.

Real processes on each backend: the orchestrator runs as ``simpletuner server`` (SQLite: its
embedded scheduler runs the sweeps) or beside a Celery worker with embedded beat (PostgreSQL + Redis),
with timers shortened so that a lost worker is noticed in seconds; agents are real
``python -m worker_agent`` processes running the example trainer, some of them behind a TCP proxy
that can cut their link or drop an event.
"""

import fcntl
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import pytest

from .agent_harness import (
    AgentRunner,
    admin_post,
    job_in,
    job_mid_run,
    job_when,
    process_gone,
    trainer_processes,
    worker_when,
    write_import_blocker,
)
from .faults import TcpProxy
from ..services import require_postgres_url, require_redis_url
from .harness import Fleet, Orchestrator, create_database, drop_database, poll

pytestmark = pytest.mark.e2e

HEARTBEAT_INTERVAL_S = 1
HEARTBEAT_TIMEOUT_S = 3
SWEEP_INTERVAL_S = 1
ACK_TIMEOUT_S = 3
TIMERS = {
    "SIMPLETUNER_HEARTBEAT_INTERVAL": str(HEARTBEAT_INTERVAL_S),
    "SIMPLETUNER_HEARTBEAT_TIMEOUT": str(HEARTBEAT_TIMEOUT_S),
    "SIMPLETUNER_HEALTH_CHECK_INTERVAL": str(SWEEP_INTERVAL_S),
    "SIMPLETUNER_DISPATCH_ACK_TIMEOUT": str(ACK_TIMEOUT_S),
}
# A silent worker is offline (and its job recovered) within the timeout plus a sweep; the rest is slack
# for a loaded machine.
LOST_DEADLINE_S = HEARTBEAT_TIMEOUT_S + 2 * SWEEP_INTERVAL_S + 6
ACK_DEADLINE_S = ACK_TIMEOUT_S + 2 * SWEEP_INTERVAL_S + 6
JOB_DEADLINE_S = 40
# A negative check (nothing more happens) watches this long: a couple of sweep intervals and heartbeats.
QUIET_WINDOW_S = 3 * SWEEP_INTERVAL_S
# Each orchestrator's Celery queue lives in a Redis database of its own (not 0, a developer's default),
# so that no other Celery worker on that Redis (this module's other orchestrator, a concurrent test
# run) takes its sweeps and runs them against another database. A database is claimed with a lock
# file held while the orchestrator runs; the kernel releases it if this process dies.
CELERY_REDIS_DBS = range(1, 16)
REDIS_DB_LOCKS = Path(tempfile.gettempdir())

TERMINAL = ("completed", "failed", "cancelled")
SHORT_JOB = {"max_train_steps": 30, "step_delay": 0.1, "checkpoint_every": 10}  # ~3 s
MEDIUM_JOB = {"max_train_steps": 120, "step_delay": 0.08, "checkpoint_every": 20}  # ~10 s
LONG_JOB = {"max_train_steps": 2000, "step_delay": 0.05}  # 100 s: only ever stopped early


# --- fixtures -------------------------------------------------------------------------------------


def _claim_redis_db(url):
    """Return (URL of a Redis database no other run of these tests uses, the open lock file holding it)."""
    parts = urlsplit(url)
    for db in CELERY_REDIS_DBS:
        lock = open(REDIS_DB_LOCKS / f"simpletuner-e2e-celery-{parts.port or 6379}-{db}.lock", "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment)), lock
    pytest.fail(f"every Redis database in {CELERY_REDIS_DBS} is taken by another test run")


class Servers:
    """Starts orchestrators with sweeps for one backend; stops them (and drops their databases) at ``close``."""

    def __init__(self, backend, tmp_path_factory):
        self.backend = backend
        self.tmp_path_factory = tmp_path_factory
        self.started = []
        self.databases = []
        self.locks = []
        if backend == "postgres":
            self.postgres_url = require_postgres_url()
            self.redis_url = require_redis_url()

    def start(self, **timers):
        env = {**TIMERS, **timers}
        data_dir = self.tmp_path_factory.mktemp(f"faults-{self.backend}")
        if self.backend == "postgres":
            database = create_database(self.postgres_url)
            self.databases.append(database)
            redis_url, lock = _claim_redis_db(self.redis_url)
            self.locks.append(lock)
            server = Orchestrator(
                backend=self.backend,
                data_dir=data_dir,
                database_url=database,
                redis_url=redis_url,
                via_cli=True,
                celery=True,
                extra_env=env,
            )
        else:
            server = Orchestrator(backend=self.backend, data_dir=data_dir, via_cli=True, extra_env=env)
        self.started.append(server)
        return server.start()

    def close(self):
        for server in self.started:
            server.stop()
        for database in self.databases:
            drop_database(self.postgres_url, database)
        for lock in self.locks:
            lock.close()


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
    ],
)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def server(backend, tmp_path_factory):
    """One orchestrator with sweeps and short timers per backend, shared by this module's tests."""
    servers = Servers(backend, tmp_path_factory)
    try:
        yield servers.start()
    finally:
        servers.close()


@pytest.fixture
def own_server(backend, tmp_path_factory):
    """An orchestrator for this test alone (it is killed and restarted)."""
    servers = Servers(backend, tmp_path_factory)
    yield servers
    servers.close()


@pytest.fixture(scope="module")
def blocker_dir(tmp_path_factory):
    return write_import_blocker(tmp_path_factory.mktemp("no-django"))


def _show_logs(orchestrator, offsets):
    """Print the server's (and Celery's) log since ``offsets``: pytest shows it for a failing test."""
    print(f"\n===== orchestrator log ({orchestrator.backend}, {orchestrator.log_path})")
    print(orchestrator.read_log(offsets[0]))
    if orchestrator.celery:
        print(f"\n===== celery log ({orchestrator.celery_log_path})")
        print(orchestrator.read_celery_log(offsets[1]))


class Stage:
    """A fleet and an agent runner on one orchestrator, torn down (agents killed, logs shown) after the test."""

    def __init__(self, orchestrator, request, tmp_path, blocker_dir):
        self.orch = orchestrator
        self.fleet = Fleet(orchestrator, request.node.originalname.removeprefix("test_").replace("_", "-"))
        self.agents = AgentRunner(orchestrator, self.fleet, tmp_path, blocker_dir=blocker_dir)
        self.proxies = []
        self.offsets = (orchestrator.log_size(), orchestrator.celery_log_size())

    def proxy(self):
        """Return a started TCP proxy to the orchestrator (stopped at teardown)."""
        proxy = TcpProxy("127.0.0.1", self.orch.port).start()
        self.proxies.append(proxy)
        return proxy

    def worker(self, **labels):
        return self.fleet.create_worker(labels={"pool": self.fleet.tag, **labels})

    def start(self, *workers, **kwargs):
        """Start an agent for each worker (all at once), wait until each is connected; return them."""
        started = [self.agents.start(worker, **kwargs) for worker in workers]
        for agent in started:
            self.agents.wait_ready(agent)
        return started

    def submit(self, config, **fields):
        return self.agents.submit(labels={"pool": self.fleet.tag}, config=config, **fields)["job_id"]

    def close(self):
        for proxy in self.proxies:
            proxy.stop()
        self.agents.cleanup()
        if self.orch.is_alive():
            self.fleet.cleanup()
        _show_logs(self.orch, self.offsets)


@pytest.fixture
def stage(server, request, tmp_path, blocker_dir):
    stage = Stage(server, request, tmp_path, blocker_dir)
    yield stage
    stage.close()


# --- helpers ----------------------------------------------------------------------------------------


def attempts(job):
    return [(a["worker_id"], a["outcome"]) for a in job["attempts"]]


def running_on(job):
    """The worker id of a job that runs (acknowledged, trainer up), else None."""
    return job["worker_id"] if job["status"] == "running" else None


def trainer_of(agent, job_id):
    """Return the trainer process of ``job_id`` under ``agent`` (there must be exactly one)."""
    job_dir = agent.work_dir / job_id
    (trainer,) = poll(lambda: trainer_processes(job_dir), timeout=10, message=f"the trainer process in {job_dir}")
    return trainer


def assert_gone(process, *, timeout=30, what="process"):
    # Generous: a trainer stopped by SIGTERM writes and fsyncs its checkpoint first, which took over
    # 10 s once on this 2-core machine while another suite and PostgreSQL were busy beside it.
    poll(lambda: process_gone(process), timeout=timeout, message=f"{what} pid {process.pid} to end")


def started_lines(agent, job_id):
    return agent.lines_matching(f"Job {job_id} started")


def audit_rows(orchestrator, **params):
    """Return the audit rows matching ``params``, oldest first (the API lists newest first)."""
    return sorted(orchestrator.audit(**params), key=lambda row: row["id"])


def requeues(orchestrator, job_id):
    return [row["details"] for row in audit_rows(orchestrator, target_id=job_id, action="job.requeued")]


# --- 1. an agent killed mid-job ----------------------------------------------------------------------


def test_killed_agent_job_requeued_with_a_retry_and_completed_elsewhere(server, stage):
    first, second = stage.worker(), stage.worker()
    agent_of = dict(zip((first.id, second.id), stage.start(first, second)))
    job_id = stage.submit(SHORT_JOB)

    job = job_mid_run(server, job_id)
    lost_id = job["worker_id"]
    lost_agent = agent_of.pop(lost_id)
    (survivor_id, survivor_agent) = agent_of.popitem()
    trainer = trainer_of(lost_agent, job_id)

    lost_agent.kill()  # SIGKILL: no disconnect, no report; only the heartbeat timeout tells
    # The trainer goes with its agent (parent-death signal), so the lost node leaves no stray training.
    assert_gone(trainer, what="the lost agent's trainer")

    requeued = job_when(
        server, job_id, lambda j: j["retry_count"] == 1, timeout=LOST_DEADLINE_S, message="job requeued"
    )
    assert requeued["status"] in ("queued", "dispatched", "running"), requeued
    offline = worker_when(server, lost_id, lambda w: w["status"] == "offline", message="lost worker offline")
    assert offline["current_job_id"] is None

    job = job_in(server, job_id, *TERMINAL, timeout=JOB_DEADLINE_S)
    assert (job["status"], job["worker_id"], job["exit_code"]) == ("completed", survivor_id, 0), job
    assert (job["attempt_count"], job["retry_count"]) == (2, 1)
    assert attempts(job) == [(lost_id, "lost"), (survivor_id, "completed")]
    assert f"no heartbeat for {HEARTBEAT_TIMEOUT_S:g} s" in job["attempts"][0]["error"]
    assert job["progress"]["step"] == SHORT_JOB["max_train_steps"]

    (requeue,) = requeues(server, job_id)
    assert (requeue["retry_spent"], requeue["retry_count"], requeue["previous_worker"]) == (True, 1, lost_id)
    (change,) = [
        row for row in server.audit(target_id=job_id, action="job.status_changed") if row["details"]["to"] == "queued"
    ]
    assert (change["details"]["from"], change["actor_type"], change["actor_name"]) == ("running", "system", "health-sweep")
    survivor_agent.wait_for_line(f"Job {job_id} completed in")
    assert len(started_lines(survivor_agent, job_id)) == 1


# --- 2. retries run out ---------------------------------------------------------------------------------


def test_job_fails_once_every_retry_was_lost(server, stage):
    workers = [stage.worker() for _ in range(5)]  # four attempts, and a fifth idle worker that must stay idle
    agent_of = dict(zip((w.id for w in workers), stage.start(*workers)))
    job_id = stage.submit(LONG_JOB)
    assert server.job(job_id)["max_retries"] == 3  # SIMPLETUNER_JOB_MAX_RETRIES' default

    lost = []
    for number in range(1, 5):
        job = job_when(
            server,
            job_id,
            lambda j, n=number: j["attempt_count"] == n and running_on(j) is not None,
            timeout=LOST_DEADLINE_S + 5,
            message=f"attempt {number} running",
        )
        assert job["retry_count"] == number - 1, job
        lost.append(job["worker_id"])
        agent_of[job["worker_id"]].kill()

    job = job_in(server, job_id, "failed", "completed", "cancelled", timeout=LOST_DEADLINE_S)
    assert job["status"] == "failed", job
    assert (job["attempt_count"], job["retry_count"]) == (4, 3)
    assert "retries exhausted" in job["last_error"] and "no heartbeat" in job["last_error"], job["last_error"]
    assert attempts(job) == [(worker_id, "lost") for worker_id in lost]
    assert len(set(lost)) == 4
    assert [r["retry_count"] for r in requeues(server, job_id)] == [1, 2, 3]

    # No fifth attempt: the one worker left is idle and connected, and stays out of it.
    (spare_id,) = set(agent_of) - set(lost)
    spare = agent_of[spare_id]
    spare.assert_keeps_running(QUIET_WINDOW_S)
    job = server.job(job_id)
    assert (job["status"], job["attempt_count"], len(job["attempts"])) == ("failed", 4, 4), job
    state = server.worker(spare_id)
    assert (state["status"], state["current_job_id"]) == ("idle", None)
    assert not spare.has_line(job_id), spare.describe()
    assert [r["details"]["worker"] for r in audit_rows(server, target_id=job_id, action="job.dispatched")] == lost


def test_failing_trainer_with_retry_on_failure_is_retried_once(server, stage):
    worker = stage.worker()
    (agent,) = stage.start(worker)
    config = {"max_train_steps": 20, "step_delay": 0.02, "fail_at_step": 3}
    job_id = stage.submit(config, retry_on_failure=True, max_retries=1)

    job = job_in(server, job_id, *TERMINAL, timeout=JOB_DEADLINE_S)
    assert job["status"] == "failed", job
    assert (job["attempt_count"], job["retry_count"], job["exit_code"]) == (2, 1, 3)
    assert attempts(job) == [(worker.id, "failed"), (worker.id, "failed")]
    assert "retries exhausted" in job["last_error"] and "exited with code 3" in job["last_error"], job["last_error"]
    (requeue,) = requeues(server, job_id)
    assert (requeue["retry_spent"], requeue["retry_count"], requeue["max_retries"]) == (True, 1, 1)

    # The worker is free again and no third attempt comes.
    second_failure = agent.wait_for_line(
        f"Job {job_id} failed after", after=agent.wait_for_line(f"Job {job_id} failed after") + 1
    )
    agent.wait_for_line("Waiting for jobs", after=second_failure)
    worker_when(server, worker.id, lambda w: (w["status"], w["current_job_id"]) == ("idle", None))
    assert len(started_lines(agent, job_id)) == 2
    job = server.job(job_id)
    assert (job["status"], job["attempt_count"]) == ("failed", 2)


# --- 3. the orchestrator killed mid-job ------------------------------------------------------------------


def test_orchestrator_killed_and_restarted_mid_job_the_job_completes_once(own_server, request, tmp_path, blocker_dir):
    # The outage (restart plus the agent's reconnect backoff) must stay under the heartbeat timeout;
    # see test_outage_longer_than_the_heartbeat_timeout for what happens when it does not.
    orchestrator = own_server.start(SIMPLETUNER_HEARTBEAT_TIMEOUT="20")
    stage = Stage(orchestrator, request, tmp_path, blocker_dir)
    try:
        worker = stage.worker()
        (agent,) = stage.start(worker)
        job_id = stage.submit({"max_train_steps": 150, "step_delay": 0.08, "checkpoint_every": 50})  # ~12 s
        job_mid_run(orchestrator, job_id)
        trainer = trainer_of(agent, job_id)

        orchestrator.kill()
        lost_line = agent.wait_for_line("Stream to the orchestrator lost")
        assert trainer.is_running() and not process_gone(trainer), "the trainer must outlive the orchestrator"
        orchestrator.restart()

        again = agent.wait_for_line(f"Registered again as {worker.name} ({worker.id})", after=lost_line, timeout=20)
        agent.wait_for_line(f"The orchestrator confirmed job {job_id} is still ours", after=again, timeout=0)
        assert not process_gone(trainer), "the trainer was stopped although the job was resumed"

        job = job_in(orchestrator, job_id, *TERMINAL, "queued", timeout=JOB_DEADLINE_S)
        assert (job["status"], job["worker_id"], job["exit_code"]) == ("completed", worker.id, 0), job
        assert (job["attempt_count"], job["retry_count"]) == (1, 0)
        assert attempts(job) == [(worker.id, "completed")]
        assert job["progress"]["step"] == 150
        assert_gone(trainer, what="the finished trainer")
        agent.wait_for_line(f"Job {job_id} completed in")
        assert len(started_lines(agent, job_id)) == 1, agent.describe()
        assert not requeues(orchestrator, job_id)
        registrations = orchestrator.audit(target_id=worker.id, action="worker.registered")
        resumed = [row["details"] for row in registrations if row["details"]["reported_job"] == job_id]
        assert [r["resumed"] for r in resumed] == [True], registrations
        assert "training complete: step 150" in (agent.work_dir / job_id / "train.log").read_text()
    finally:
        stage.close()


# --- 4. a network partition ------------------------------------------------------------------------------


def test_partitioned_worker_loses_its_job_and_is_refused_when_it_returns(server, stage):
    behind, direct = stage.worker(), stage.worker()
    proxy = stage.proxy()
    (cut_off,) = stage.start(behind, orchestrator_url=proxy.url)
    job_id = stage.submit(MEDIUM_JOB)  # only the proxied worker is up: it gets the job
    (other,) = stage.start(direct)

    job = job_mid_run(server, job_id)
    assert job["worker_id"] == behind.id
    trainer = trainer_of(cut_off, job_id)

    proxy.cut()
    job = job_when(
        server, job_id, lambda j: running_on(j) == direct.id, timeout=LOST_DEADLINE_S + 5, message="job running on B"
    )
    assert (job["attempt_count"], job["retry_count"]) == (2, 1)
    assert attempts(job) == [(behind.id, "lost"), (direct.id, "")]
    assert server.worker(behind.id)["status"] == "offline"
    # The cut-off agent still trains its copy: it cannot know yet.
    assert not process_gone(trainer)
    assert proxy.refused > 0  # its heartbeats, reports and reconnects were turned away meanwhile

    proxy.heal()
    abandoned = cut_off.wait_for_line(f"Abandoning job {job_id}", timeout=15)
    # Whichever reaches the healed orchestrator first says so: a heartbeat's refusal, or the
    # re-registration's abandon_job.
    line = cut_off.lines()[abandoned]
    assert "not assigned to worker" in line or "no longer this worker's job" in line, line
    assert_gone(trainer, what="the abandoned trainer")
    cut_off.wait_for_line(f"Job {job_id} stopped", after=abandoned)
    assert "stopped by signal at step" in (cut_off.work_dir / job_id / "train.log").read_text()
    worker_when(server, behind.id, lambda w: w["status"] == "idle", message="the returning worker idle again")

    job = job_in(server, job_id, *TERMINAL, timeout=JOB_DEADLINE_S)
    assert (job["status"], job["worker_id"], job["exit_code"]) == ("completed", direct.id, 0), job
    assert attempts(job) == [(behind.id, "lost"), (direct.id, "completed")]
    assert job["progress"]["step"] == MEDIUM_JOB["max_train_steps"]
    other.wait_for_line(f"Job {job_id} completed in")
    # The returning agent learnt it from a refused heartbeat (409, above) and reported nothing more;
    # nothing it sent since the cut was applied: its only status change is its first "running".
    changes = server.audit(target_id=job_id, action="job.status_changed")
    assert [row["details"]["to"] for row in changes if row["actor_id"] == behind.id] == ["running"], changes
    assert not cut_off.has_line(f"Job {job_id} completed"), cut_off.describe()
    assert cut_off.running()
    # A late result for its old attempt (what it would have sent had its trainer finished while cut
    # off) is refused and changes nothing. It is audited within the bound a worker's refusals have: the
    # first refusal of a window writes its row (the returning heartbeat's, when that came first), later
    # ones in the window are counted in the next window's row.
    old_attempt = job["attempts"][0]["lease_id"]
    before = len(server.audit(target_id=job_id, action="job.report_refused"))
    refusal = behind.report(job_id, "completed", status=409, attempt=old_attempt, exit_code=0)
    assert refusal["code"] == "job_not_owned", refusal
    refused = server.audit(target_id=job_id, action="job.report_refused")
    assert max(before, 1) <= len(refused) <= before + 1
    assert {(row["actor_id"], row["success"]) for row in refused} == {(behind.id, False)}
    job = server.job(job_id)
    assert (job["status"], job["worker_id"]) == ("completed", direct.id)
    assert attempts(job) == [(behind.id, "lost"), (direct.id, "completed")]


# --- 5. a dispatch lost on its way ----------------------------------------------------------------------


def test_lost_dispatch_is_requeued_without_spending_a_retry(server, stage):
    worker = stage.worker()
    proxy = stage.proxy()
    (agent,) = stage.start(worker, orchestrator_url=proxy.url)
    proxy.drop_next("job_submit")
    job_id = stage.submit(SHORT_JOB)

    poll(lambda: proxy.dropped, timeout=10, message="the job_submit push to be dropped")
    assert job_id.encode() in proxy.dropped[0]
    dispatched = server.job(job_id)
    assert (dispatched["status"], dispatched["worker_id"]) == ("dispatched", worker.id), dispatched

    requeued = job_when(
        server, job_id, lambda j: j["attempt_count"] == 2, timeout=ACK_DEADLINE_S, message="job dispatched again"
    )
    assert requeued["retry_count"] == 0, requeued
    assert requeued["attempts"][0]["outcome"] == "unacknowledged", requeued
    job = job_in(server, job_id, *TERMINAL, timeout=JOB_DEADLINE_S)
    assert (job["status"], job["worker_id"], job["exit_code"]) == ("completed", worker.id, 0), job
    assert (job["attempt_count"], job["retry_count"]) == (2, 0)
    assert attempts(job) == [(worker.id, "unacknowledged"), (worker.id, "completed")]
    (requeue,) = requeues(server, job_id)
    assert (requeue["retry_spent"], requeue["retry_count"]) == (False, 0), requeue
    assert "not acknowledged" in requeue["reason"], requeue

    # The agent never saw the first dispatch: it started the job once, for the second attempt.
    agent.wait_for_line(f"Job {job_id} completed in")
    (started,) = started_lines(agent, job_id)
    assert "(attempt 2)" in started, started
    assert len(proxy.dropped) == 1


def test_a_dispatch_acknowledged_only_by_heartbeats_naming_it_is_never_requeued(server, stage):
    """The deterministic repro of a job run twice: job_submit received, `starting` never sent (it was
    lost), heartbeats naming the job accepted. A heartbeat naming the job is an acknowledgement."""
    worker = stage.worker()
    worker.register()
    stream = stage.fleet.open_stream(worker)
    job_id = stage.fleet.submit({"config_name": "ack-by-heartbeat", "worker_labels": {"pool": stage.fleet.tag}})["job_id"]
    submit = stream.wait_for("job_submit", where=lambda e: e.json()["job_id"] == job_id)
    attempt = submit.json()["attempt"]

    # Heartbeats naming the job (and its attempt) for well over the acknowledgement deadline.
    deadline = time.monotonic() + ACK_DEADLINE_S
    beats = 0
    while time.monotonic() < deadline:
        worker.heartbeat({"worker_id": worker.id, "status": "busy", "current_job_id": job_id, "attempt": attempt})
        beats += 1
        time.sleep(HEARTBEAT_INTERVAL_S)

    job = server.job(job_id)
    assert beats >= 8
    assert (job["status"], job["worker_id"], job["attempt_count"], job["retry_count"]) == ("running", worker.id, 1, 0), job
    assert requeues(server, job_id) == []
    worker.report(job_id, "completed", attempt=attempt)
    assert server.job(job_id)["status"] == "completed"


def lost_mid_job(server, stage):
    """A raw-protocol worker starts a job, then goes silent until its job is requeued; return (worker, job id, attempt)."""
    worker = stage.worker()
    worker.register()
    stream = stage.fleet.open_stream(worker)
    job_id = stage.fleet.submit({"config_name": "late", "worker_labels": {"pool": stage.fleet.tag}})["job_id"]
    attempt = stream.wait_for("job_submit", where=lambda e: e.json()["job_id"] == job_id).json()["attempt"]
    worker.report(job_id, "starting", attempt=attempt)
    stream.close()  # and silence: no heartbeat until the health sweep has taken the worker offline
    job_when(server, job_id, lambda j: j["status"] == "queued", timeout=LOST_DEADLINE_S, message="the job requeued")
    return worker, job_id, attempt


def test_a_late_completion_of_a_lost_attempt_is_kept_when_nothing_ran_the_job_since(server, stage):
    """A worker that went silent mid-job (its job requeued) finishes it after all and says so with its
    attempt: the result is kept and the job does not run again."""
    worker, job_id, attempt = lost_mid_job(server, stage)
    worker.report(job_id, "completed", attempt=attempt, exit_code=0)

    job = server.job(job_id)
    assert (job["status"], job["attempt_count"], job["retry_count"]) == ("completed", 1, 0), job
    assert attempts(job) == [(worker.id, "completed")]
    (recovered,) = audit_rows(server, target_id=job_id, action="job.completion_recovered")
    assert recovered["details"]["was"] == "lost"


def test_a_late_completion_supersedes_the_attempt_that_runs_the_job_meanwhile(server, stage):
    """The chaos soak's twice-completed job: a worker went silent mid-job (its job requeued and dispatched
    to another worker), then reports that it had completed it. The result is kept; the other worker's
    attempt is superseded: it is told to stop (job_cancel) and freed, and its report is refused."""
    first, job_id, attempt = lost_mid_job(server, stage)
    second = stage.worker()
    second.register()
    second_stream = stage.fleet.open_stream(second)
    again = second_stream.wait_for("job_submit", where=lambda e: e.json()["job_id"] == job_id)
    second_attempt = again.json()["attempt"]
    second.report(job_id, "starting", attempt=second_attempt)

    first.report(job_id, "completed", attempt=attempt, exit_code=0)

    job = server.job(job_id)
    assert (job["status"], job["worker_id"], job["retry_count"]) == ("completed", first.id, 0), job
    assert attempts(job) == [(first.id, "completed"), (second.id, "superseded")]
    cancel = second_stream.wait_for("job_cancel", where=lambda e: e.json()["job_id"] == job_id)
    assert cancel.json()["attempt"] == second_attempt
    worker_when(server, second.id, lambda w: (w["status"], w["current_job_id"]) == ("idle", None), message="second freed")
    refused = second.call("POST", f"/api/workers/job/{job_id}/status", json={"status": "cancelled", "attempt": second_attempt})
    assert refused.status_code == 409, refused.text
    (recovered,) = audit_rows(server, target_id=job_id, action="job.completion_recovered")
    assert recovered["details"]["superseded"] == second_attempt


# --- 6. drain survives the agent's restart -------------------------------------------------------------


def test_drain_survives_agent_restarts_and_heartbeats(server, stage):
    worker = stage.worker()
    (agent,) = stage.start(worker)
    assert admin_post(server, f"/api/admin/workers/{worker.id}/drain")["draining"] is True
    agent.wait_for_line("Draining: this worker takes no new jobs")

    # A graceful restart (disconnect: offline, then register) and a crash (register while online).
    agent.terminate()
    assert agent.wait_exit() == 0, agent.describe()
    worker_when(server, worker.id, lambda w: w["status"] == "offline", message="worker offline after disconnect")
    (agent,) = stage.start(worker)
    agent.wait_for_line("Draining: this worker takes no new jobs")
    agent.kill()
    (agent,) = stage.start(worker)
    agent.wait_for_line("Draining: this worker takes no new jobs")
    registrations = server.audit(target_id=worker.id, action="worker.registered")
    assert len(registrations) == 3, registrations

    job_id = stage.submit(SHORT_JOB)
    # Several heartbeats later the worker still drains and the job still waits for another worker.
    seen = set()

    def heartbeats_while_draining():
        state = server.worker(worker.id)
        assert (state["status"], state["draining"]) == ("draining", True), state
        seen.add(state["last_heartbeat"])
        return len(seen) >= 4

    poll(heartbeats_while_draining, timeout=10 * HEARTBEAT_INTERVAL_S, interval=0.2, message="heartbeats")
    job = server.job(job_id)
    assert (job["status"], job["attempt_count"], job["worker_id"]) == ("queued", 0, None), job
    assert "draining" in job["waiting_reason"], job["waiting_reason"]
    assert not agent.has_line(job_id), agent.describe()
    assert agent.running()


# --- an outage longer than the heartbeat timeout -----------------------------------------------------


def test_orchestrator_down_longer_than_the_heartbeat_timeout_resumes_the_job(
    backend, own_server, request, tmp_path, blocker_dir
):
    """The orchestrator is down longer than the heartbeat timeout while a job runs, then comes back.

    Nothing is wrong with the worker: it kept training and heartbeats again as soon as the server
    answers. The spec ("Orchestrator restarts: workers reconnect, report in-progress jobs, the
    orchestrator reconciles state and resumes") asks for the job to carry on.
    """
    # Servers record their presence; the heartbeat sweep (Celery beat keeps running during the
    # outage in production) counts a worker's silence only while some server was up to hear it.
    orchestrator = own_server.start()
    stage = Stage(orchestrator, request, tmp_path, blocker_dir)
    try:
        worker = stage.worker()
        (agent,) = stage.start(worker)
        job_id = stage.submit({"max_train_steps": 150, "step_delay": 0.08})  # ~12 s
        job_mid_run(orchestrator, job_id)
        trainer = trainer_of(agent, job_id)

        orchestrator.kill()
        down_since = time.monotonic()
        # Stay down past the heartbeat timeout (the fault under test is the length of the outage).
        poll(
            lambda: time.monotonic() - down_since > HEARTBEAT_TIMEOUT_S + 1,
            timeout=HEARTBEAT_TIMEOUT_S + 5,
            message="the outage to outlast the heartbeat timeout",
        )
        assert agent.has_line("Heartbeat failed") and not process_gone(trainer)
        orchestrator.restart()
        agent.wait_for_line("Heartbeats reach the orchestrator again", timeout=15)

        job = job_in(orchestrator, job_id, *TERMINAL, timeout=JOB_DEADLINE_S)
        assert (job["status"], job["worker_id"]) == ("completed", worker.id), job
        assert attempts(job) == [(worker.id, "completed")], job
        assert (job["attempt_count"], job["retry_count"]) == (1, 0)
        assert not agent.has_line(f"Abandoning job {job_id}"), agent.describe()
        assert len(started_lines(agent, job_id)) == 1, agent.describe()
    finally:
        stage.close()
