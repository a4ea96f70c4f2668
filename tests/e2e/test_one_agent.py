"""One agent's results and jobs are its own: agents of two workers sharing one work dir, and two agents on one token.

Real processes: a real orchestrator and real ``python -m worker_agent`` processes (without Django), on each backend.
"""

import json
import re
import secrets
import socket

import pytest

from ..services import require_postgres_url, require_redis_url
from .agent_harness import AgentRunner, job_in, job_mid_run, worker_when
from .faults import TcpProxy
from .harness import Fleet, Orchestrator, create_database, drop_database, poll

pytestmark = pytest.mark.e2e

JOB_DEADLINE_S = 30
NEGATIVE_WINDOW_S = 2
CUT_JOB = {"max_train_steps": 60, "step_delay": 0.1, "checkpoint_every": 20}  # ~6 s


def test_agents_of_two_workers_sharing_a_work_dir_deliver_only_their_own_results(orchestrator, fleet, agents, tmp_path):
    """One agent per GPU on one host, one work dir: the first worker's trainer finishes while the orchestrator
    cannot be reached and its agent dies holding the result. The other worker's agent, restarted while the
    orchestrator is still unreachable, leaves that result alone; the first worker's next agent delivers it,
    and the job completes on its one attempt, never run again."""
    shared = tmp_path / "shared-jobs"
    pool = fleet.tag
    first_worker = fleet.create_worker(labels={"pool": pool, "gpu": "0"})
    second_worker = fleet.create_worker(labels={"pool": pool, "gpu": "1"})
    proxy = TcpProxy("127.0.0.1", orchestrator.port).start()
    try:
        first, second = (
            agents.start(worker, orchestrator_url=proxy.url, extra_args=("--work-dir", str(shared)))
            for worker in (first_worker, second_worker)
        )
        first.work_dir, second.work_dir = shared / first_worker.id, shared / second_worker.id
        for agent in (first, second):
            agents.wait_ready(agent)
        job_id = agents.submit(labels={"pool": pool, "gpu": "0"}, config=CUT_JOB)["job_id"]
        job_dir = shared / first_worker.id / job_id
        journal_path = job_dir / "outcome.json"
        (attempt,) = [a["lease_id"] for a in job_mid_run(orchestrator, job_id)["attempts"]]

        proxy.cut()  # the orchestrator is down, for both agents
        poll(journal_path.exists, timeout=JOB_DEADLINE_S, message=f"{journal_path} to be written")
        assert json.loads(journal_path.read_text())["worker_id"] == first_worker.id
        first.wait_for_line(re.compile(rf"Could not report job {job_id} \("))
        first.kill()  # dies holding the result: only the journal remains
        second.kill()
        second_again = agents.again(second, label="second-again")
        second_again.wait_for_line("Cannot register")  # started while the orchestrator is down
        assert journal_path.exists()

        proxy.heal()
        second_again.wait_for_line(f"Registered as {second_worker.name} ({second_worker.id})")
        second_again.assert_keeps_running(NEGATIVE_WINDOW_S)
        assert journal_path.exists() and not (job_dir / "outcome.reported.json").exists()
        assert not second_again.has_line(job_id), second_again.describe()
        assert not orchestrator.audit(target_id=job_id, action="job.report_refused")
        assert orchestrator.job(job_id)["status"] == "running"  # nobody reported it: still the first worker's

        first_again = agents.again(first, label="first-again")
        reported = first_again.wait_for_line(f"Reported the result of job {job_id} (attempt {attempt}: completed) kept from before")
        registered = first_again.wait_for_line(f"Registered as {first_worker.name} ({first_worker.id})")
        assert reported < registered, first_again.describe()
        job = job_in(orchestrator, job_id, "completed", "failed", "cancelled", "queued", timeout=JOB_DEADLINE_S)
        assert (job["status"], job["attempt_count"], job["worker_id"]) == ("completed", 1, first_worker.id), job
        assert not journal_path.exists() and (job_dir / "outcome.reported.json").is_file()
        worker_when(orchestrator, first_worker.id, lambda w: (w["status"], w["current_job_id"]) == ("idle", None))
        assert (job_dir / "train.log").read_text().count("training complete") == 1  # it never ran again
        assert not orchestrator.audit(target_id=job_id, action="job.requeued")
    finally:
        proxy.stop()


QUICK_JOB = {"max_train_steps": 10, "step_delay": 0.05}


def test_a_second_agent_on_one_token_takes_the_worker_over_and_the_job_runs_on_it_once(orchestrator, fleet, agents):
    """Two agents started with one worker's token: the second takes the worker over; the first is told who did,
    and exits 1 saying so; the next job runs on the second only, once; the worker shows the agent that serves."""
    pool = {"pool": fleet.tag}
    worker = fleet.create_worker(labels=pool)
    first = agents.start(worker)
    agents.wait_ready(first)
    second = agents.start(worker, extra_args=("--name", "the-second"))
    assert first.wait_exit(timeout=JOB_DEADLINE_S) == 1, first.describe()
    told = first.lines_matching("another agent took this worker over with the same token")
    assert len(told) == 1 and f"(the-second on {socket.gethostname()}); this agent stops" in told[0], first.describe()
    assert "one agent per worker" in told[0] and not first.has_line("Disconnecting"), first.describe()
    second.wait_for_line(f"Registered as the-second ({worker.id})")
    state = worker_when(orchestrator, worker.id, lambda w: w["stream_connected"] and w["status"] == "idle")
    assert (state["serving_agent"]["name"], state["open_streams"]) == ("the-second", 1), state
    second.assert_keeps_running(NEGATIVE_WINDOW_S)  # its stream's own dispatch (nothing queued) is done

    job_id = agents.submit(labels=pool, config=QUICK_JOB)["job_id"]
    job = job_in(orchestrator, job_id, "completed", "failed", "cancelled", timeout=JOB_DEADLINE_S)
    assert (job["status"], job["attempt_count"], job["worker_id"]) == ("completed", 1, worker.id), job
    assert (second.work_dir / job_id / "train.log").read_text().count("training complete") == 1
    assert not (first.work_dir / job_id).exists() and not first.has_line(job_id)
    assert len(second.lines_matching(f"Job {job_id} started")) == 1
    second.assert_keeps_running(NEGATIVE_WINDOW_S)
    (replaced,) = orchestrator.audit(target_id=worker.id, action="worker.agent_replaced")
    assert replaced["details"]["by"]["name"] == "the-second", replaced


def test_an_agent_reconnecting_after_a_cut_is_no_second_agent(orchestrator, fleet, agents):
    """The link of the one agent of a worker is cut and heals: it registers and streams again as itself, takes
    nothing over, is told nothing, and runs the next job."""
    pool = {"pool": fleet.tag}
    worker = fleet.create_worker(labels=pool)
    proxy = TcpProxy("127.0.0.1", orchestrator.port).start()
    try:
        agent = agents.start(worker, orchestrator_url=proxy.url)
        agents.wait_ready(agent)
        proxy.cut()
        lost = agent.wait_for_line("Stream to the orchestrator lost")
        proxy.heal()
        agent.wait_for_line(f"Registered again as {worker.name} ({worker.id})", after=lost, timeout=JOB_DEADLINE_S)
        worker_when(orchestrator, worker.id, lambda w: w["stream_connected"] and w["status"] == "idle")
        agent.assert_keeps_running(NEGATIVE_WINDOW_S)  # not told anything; its stream's own dispatch is done
        job_id = agents.submit(labels=pool, config=QUICK_JOB)["job_id"]
        job = job_in(orchestrator, job_id, "completed", "failed", "cancelled", timeout=JOB_DEADLINE_S)
        assert (job["status"], job["attempt_count"]) == ("completed", 1), job
        assert not agent.has_line("another agent took this worker over"), agent.describe()
        assert not orchestrator.audit(target_id=worker.id, action="worker.agent_replaced")
    finally:
        proxy.stop()


def test_an_agent_taken_over_while_its_link_was_cut_stops_when_it_comes_back(orchestrator, fleet, agents):
    """The first agent's link is cut; meanwhile a second agent starts with the token and takes the worker over.
    When the link heals, the first is refused (it was not there to be told) and exits 1 saying so; the second
    keeps the worker and runs the job."""
    pool = {"pool": fleet.tag}
    worker = fleet.create_worker(labels=pool)
    proxy = TcpProxy("127.0.0.1", orchestrator.port).start()
    try:
        first = agents.start(worker, orchestrator_url=proxy.url)
        agents.wait_ready(first)
        proxy.cut()
        first.wait_for_line("Stream to the orchestrator lost")
        second = agents.start(worker, extra_args=("--name", "the-second"))
        second.wait_for_line(f"Registered as the-second ({worker.id})")
        proxy.heal()
        assert first.wait_exit(timeout=JOB_DEADLINE_S) == 1, first.describe()
        assert first.has_line(f"another agent took this worker over with the same token (the-second on {socket.gethostname()})")
        worker_when(orchestrator, worker.id, lambda w: w["stream_connected"] and w["serving_agent"]["name"] == "the-second")
        second.assert_keeps_running(NEGATIVE_WINDOW_S)
        job_id = agents.submit(labels=pool, config=QUICK_JOB)["job_id"]
        job = job_in(orchestrator, job_id, "completed", "failed", "cancelled", timeout=JOB_DEADLINE_S)
        assert (job["status"], job["attempt_count"]) == ("completed", 1), job
        assert len(second.lines_matching(f"Job {job_id} started")) == 1 and not first.has_line(job_id)
        second.assert_keeps_running(NEGATIVE_WINDOW_S)
    finally:
        proxy.stop()


@pytest.fixture
def two_servers(tmp_path_factory):
    """Server processes A and B sharing a fresh PostgreSQL database and Redis (skipped without them)."""
    postgres_url, redis_url = require_postgres_url(), require_redis_url()
    database = create_database(postgres_url)
    shared = {"DJANGO_SECRET_KEY": secrets.token_urlsafe(50)}  # one key: an upload token signed by A is B's too
    servers = []
    try:
        for name in ("a", "b"):
            data_dir = tmp_path_factory.mktemp(f"one-agent-{name}")
            server = Orchestrator(
                backend=f"postgres-{name}", data_dir=data_dir, database_url=database, redis_url=redis_url, extra_env=shared
            )
            servers.append(server.start())
        yield servers
    finally:
        for server in servers:
            print(f"\n===== server {server.backend} log\n{server.read_log()}")
            server.stop()
        drop_database(postgres_url, database)


@pytest.mark.postgres
@pytest.mark.redis
def test_a_takeover_through_another_server_process_is_seen_by_the_first_agents_server(two_servers, request, tmp_path, blocker_dir):
    """The first agent streams from server A, the second registers and streams through server B: A's stream is
    told (through Redis) and ends, and the job submitted to A runs on the second agent alone."""
    a, b = two_servers
    fleet = Fleet(a, "takeover-across")
    agents = AgentRunner(a, fleet, tmp_path, blocker_dir=blocker_dir)
    try:
        pool = {"pool": fleet.tag}
        worker = fleet.create_worker(labels=pool)
        first = agents.start(worker)
        agents.wait_ready(first)
        second = agents.start(worker, orchestrator_url=b.base_url, extra_args=("--name", "via-b"))
        assert first.wait_exit(timeout=JOB_DEADLINE_S) == 1, first.describe()
        assert first.has_line(f"another agent took this worker over with the same token (via-b on {socket.gethostname()})")
        second.wait_for_line(f"Registered as via-b ({worker.id})")
        worker_when(a, worker.id, lambda w: w["stream_connected"] and w["serving_agent"]["name"] == "via-b")
        second.assert_keeps_running(NEGATIVE_WINDOW_S)
        job_id = agents.submit(labels=pool, config=QUICK_JOB)["job_id"]
        job = job_in(a, job_id, "completed", "failed", "cancelled", timeout=JOB_DEADLINE_S)
        assert (job["status"], job["attempt_count"]) == ("completed", 1), job
        assert len(second.lines_matching(f"Job {job_id} started")) == 1 and not first.has_line(job_id)
    finally:
        agents.cleanup()
        fleet.cleanup()
