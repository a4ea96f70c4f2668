"""The worker agent end to end: real ``python -m worker_agent`` processes (without Django) against a real orchestrator."""

import hashlib
import json
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

from .agent_harness import (
    BLOCKED_MARK,
    BLOCKED_MODULES,
    admin_post,
    agent_environment,
    job_in,
    job_mid_run,
    process_gone,
    trainer_processes,
    worker_when,
)
from worker_agent import protocol, supervisor

from .faults import TcpProxy
from .harness import expect, free_port, poll

pytestmark = pytest.mark.e2e

# An agent that has decided to leave (disconnected) must be gone within PROMPT_EXIT_S; GRACEFUL_EXIT_S
# also covers the job it finishes first. (The SSE keep-alive comes every 20 s: an agent waiting on its
# stream to close would need ~20 s, and fails these bounds.)
PROMPT_EXIT_S = 5
GRACEFUL_EXIT_S = 10
JOB_DEADLINE_S = 30
NEGATIVE_WINDOW_S = 1.5

# ~3.5 s on the example trainer: 35 steps of 0.1 s, a checkpoint every 10 steps.
SHORT_JOB = {"max_train_steps": 35, "step_delay": 0.1, "learning_rate": 0.05, "seed": 7, "checkpoint_every": 10}
QUICK_JOB = {"max_train_steps": 5, "step_delay": 0.02}
LONG_JOB = {"max_train_steps": 2000, "step_delay": 0.05}  # 100 s: only ever stopped early


def no_traceback(agent):
    assert "Traceback" not in agent.output(), f"the agent printed a traceback\n{agent.describe()}"


def audit_status_changes(orchestrator, job_id):
    rows = orchestrator.audit(target_id=job_id, action="job.status_changed")
    return {(row["details"]["from"], row["details"]["to"]) for row in rows}


# --- 10. the agent's environment -------------------------------------------------------------------


def test_agent_environment_cannot_import_the_orchestrator_stack(blocker_dir):
    env = agent_environment(blocker_dir)
    for module in BLOCKED_MODULES:
        result = subprocess.run(
            [sys.executable, "-c", f"import {module}"], env=env, capture_output=True, text=True, timeout=60
        )
        assert result.returncode == 1, f"import {module} did not fail: {result}"
        assert "ModuleNotFoundError" in result.stderr and BLOCKED_MARK in result.stderr, result.stderr
    # The premise: without the blocker the same interpreter does have Django.
    control = subprocess.run(
        [sys.executable, "-c", "import django, rest_framework, daphne, channels, celery"],
        env=agent_environment(blocker_dir, PYTHONPATH=None),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert control.returncode == 0, control.stderr
    # Every module of the agent imports under the blocker.
    modules = ["worker_agent", "worker_agent.agent", "worker_agent.cli", "worker_agent.example_trainer"]
    script = f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\nprint('ok')"
    agent_side = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert (agent_side.returncode, agent_side.stdout.strip()) == (0, "ok"), agent_side.stderr


# --- 1. a job from submission to completion ---------------------------------------------------------


def test_job_runs_to_completion_with_progress(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag, "gpu_type": "cpu"})
    agent = agents.start(worker)
    agents.wait_ready(agent)

    submitted = agents.submit(labels={"pool": fleet.tag, "gpu_type": "c*"}, config=SHORT_JOB)
    job_id = submitted["job_id"]

    mid = job_mid_run(orchestrator, job_id)
    assert mid["worker_id"] == worker.id
    assert 0 < mid["progress"]["step"] < mid["progress"]["total_steps"] == SHORT_JOB["max_train_steps"]
    assert worker.state()["current_job_id"] == job_id

    job = job_in(orchestrator, job_id, "completed", "failed", "cancelled", timeout=JOB_DEADLINE_S)
    assert job["status"] == "completed", job
    assert job["exit_code"] == 0
    assert job["progress"]["fraction"] == 1.0
    assert job["progress"]["step"] == job["progress"]["total_steps"] == 35
    assert "training complete: step 35" in job["log_tail"]
    assert job["last_error"] == ""
    assert [a["outcome"] for a in job["attempts"]] == ["completed"]

    job_dir = agent.work_dir / job_id
    # The agent declares the output directory it uploads at the end, <job dir>/output, and its webhook receiver.
    written = json.loads((job_dir / "config.json").read_text())
    assert [hook["webhook_type"] for hook in written.pop("webhook_config")] == ["raw"]
    assert written == {**SHORT_JOB, "output_dir": str(job_dir / "output")}
    checkpoint = json.loads((job_dir / "output" / "checkpoint.json").read_text())
    assert (checkpoint["step"], checkpoint["complete"], checkpoint["seed"]) == (35, True, 7)
    stored = {a["key"]: a for a in job["artifacts"]}
    assert {"output/checkpoint.json", "output/checkpoint-10/checkpoint.json", "output/checkpoint-30/checkpoint.json"} <= set(stored)
    assert stored["output/checkpoint.json"]["sha256"] == hashlib.sha256((job_dir / "output" / "checkpoint.json").read_bytes()).hexdigest()

    dispatched = orchestrator.audit(target_id=job_id, action="job.dispatched")
    assert [row["details"]["worker"] for row in dispatched] == [worker.id]
    assert audit_status_changes(orchestrator, job_id) == {
        ("queued", "dispatched"),
        ("dispatched", "running"),
        ("running", "completed"),
    }

    worker_when(orchestrator, worker.id, lambda w: (w["status"], w["current_job_id"]) == ("idle", None))
    agent.wait_for_line(f"Job {job_id} completed in")
    for line in (
        f"Registered as {worker.name} ({worker.id})",
        "Waiting for jobs",
        f"Job {job_id} started",
        re.compile(rf"Job {job_id}: step \d+/35 \(\d+%\)"),
    ):
        assert agent.has_line(line), f"{line!r} missing\n{agent.describe()}"
    assert agent.running()
    no_traceback(agent)


# --- 2. label routing --------------------------------------------------------------------------------


def test_jobs_route_by_labels(orchestrator, fleet, agents):
    a100 = fleet.create_worker(labels={"pool": fleet.tag, "gpu_type": "a100-80g"})
    h100 = fleet.create_worker(labels={"pool": fleet.tag, "gpu_type": "h100"})
    a100_agent, h100_agent = agents.start(a100), agents.start(h100)
    agents.wait_ready(a100_agent)
    agents.wait_ready(h100_agent)

    for_h100 = agents.submit(labels={"pool": fleet.tag, "gpu_type": "h100"}, config=QUICK_JOB)["job_id"]
    for_a100 = agents.submit(labels={"pool": fleet.tag, "gpu_type": "a100*"}, config=QUICK_JOB)["job_id"]

    for job_id, worker, agent, other in (
        (for_h100, h100, h100_agent, a100_agent),
        (for_a100, a100, a100_agent, h100_agent),
    ):
        job = job_in(orchestrator, job_id, "completed", "failed", "cancelled", timeout=JOB_DEADLINE_S)
        assert job["status"] == "completed", job
        assert (job["worker_id"], job["worker_name"]) == (worker.id, worker.name)
        assert [(a["worker_id"], a["outcome"]) for a in job["attempts"]] == [(worker.id, "completed")]
        agent.wait_for_line(f"Job {job_id} completed in")
        assert (agent.work_dir / job_id / "output" / "checkpoint.json").is_file()
        assert not other.has_line(job_id), other.describe()
        assert not (other.work_dir / job_id).exists()


# --- 3. a failing trainer ----------------------------------------------------------------------------


def test_failing_trainer_is_reported_failed_without_retry(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = agents.start(worker)
    agents.wait_ready(agent)

    config = {"max_train_steps": 20, "step_delay": 0.05, "fail_at_step": 4}
    job_id = agents.submit(labels={"pool": fleet.tag}, config=config)["job_id"]

    job = job_in(orchestrator, job_id, "completed", "failed", "cancelled", timeout=JOB_DEADLINE_S)
    assert job["status"] == "failed", job
    assert job["exit_code"] == 3
    assert "exited with code 3" in job["last_error"]
    assert "simulated failure at step 4" in job["last_error"]
    assert "error: simulated failure at step 4 (fail_at_step)" in job["log_tail"]
    assert (job["attempt_count"], job["retry_count"]) == (1, 0)
    assert [a["outcome"] for a in job["attempts"]] == ["failed"]
    agent.wait_for_line(f"Job {job_id} failed after")

    # No retry: the worker is free again and the job is neither requeued nor dispatched anew.
    worker_when(orchestrator, worker.id, lambda w: (w["status"], w["current_job_id"]) == ("idle", None))
    agent.wait_for_line("Waiting for jobs", after=agent.wait_for_line(f"Job {job_id} failed after"))
    job = orchestrator.job(job_id)
    assert (job["status"], job["attempt_count"], len(job["attempts"])) == ("failed", 1, 1)
    assert not orchestrator.audit(target_id=job_id, action="job.requeued")
    assert agent.running()
    no_traceback(agent)


# --- 4. cancelling a running job ----------------------------------------------------------------------


def test_cancel_stops_the_running_trainer(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = agents.start(worker)
    agents.wait_ready(agent)

    job_id = agents.submit(labels={"pool": fleet.tag}, config=LONG_JOB)["job_id"]
    job_mid_run(orchestrator, job_id)
    job_dir = agent.work_dir / job_id
    (trainer,) = poll(lambda: trainer_processes(job_dir), timeout=10, message=f"the trainer process in {job_dir}")

    cancelled = admin_post(orchestrator, f"/api/queue/{job_id}/cancel")
    assert cancelled["status"] == "cancelled"

    poll(lambda: process_gone(trainer), timeout=15, message=f"trainer pid {trainer.pid} to end")
    worker_when(
        orchestrator, worker.id, lambda w: (w["status"], w["current_job_id"]) == ("idle", None), message="worker idle"
    )
    cancelled_line = agent.wait_for_line(f"Job {job_id} cancelled by the orchestrator; stopping it")
    # Whether the cancel event or a refused progress report (409 job_cancelled) told it first, the
    # agent stops the trainer and reports it cancelled, with its exit code.
    agent.wait_for_line(f"Job {job_id} cancelled after", after=cancelled_line)
    agent.wait_for_line("Waiting for jobs", after=cancelled_line)
    assert len(agent.lines_matching(f"Job {job_id} cancelled by the orchestrator")) == 1
    # The trainer was asked to stop (SIGTERM at a step boundary), not killed.
    assert "stopped by signal at step" in (job_dir / "train.log").read_text()

    job = orchestrator.job(job_id)
    assert (job["status"], job["attempt_count"], job["exit_code"]) == ("cancelled", 1, 143)
    assert [a["outcome"] for a in job["attempts"]] == ["cancelled"]
    assert "stopped by signal at step" in job["log_tail"]
    assert not trainer_processes(job_dir)
    assert agent.running()
    no_traceback(agent)


# --- 5. an ephemeral agent ----------------------------------------------------------------------------


def test_ephemeral_agent_exits_after_one_job(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag}, worker_type="ephemeral")
    agent = agents.start(worker, persistent=False)
    agents.wait_ready(agent)
    assert agent.has_line("ephemeral (exits after one job)")

    job_id = agents.submit(labels={"pool": fleet.tag}, config=QUICK_JOB)["job_id"]

    assert agent.wait_exit(timeout=JOB_DEADLINE_S + GRACEFUL_EXIT_S) == 0, agent.describe()
    job = orchestrator.job(job_id)
    assert (job["status"], job["exit_code"], job["worker_id"]) == ("completed", 0, worker.id)
    assert agent.has_line(f"Job {job_id} completed in")
    assert agent.has_line("Disconnecting (ephemeral worker: its job is done)")
    assert worker.state()["status"] == "offline"


# --- 6. drain ------------------------------------------------------------------------------------------


def test_drain_finishes_the_job_and_takes_no_new_one(orchestrator, fleet, agents):
    busy_labels = {"pool": fleet.tag, "role": "persistent"}
    busy = fleet.create_worker(labels=busy_labels)
    idle = fleet.create_worker(labels={"pool": fleet.tag, "role": "ephemeral"}, worker_type="ephemeral")
    busy_agent, idle_agent = agents.start(busy), agents.start(idle, persistent=False)
    agents.wait_ready(busy_agent)
    agents.wait_ready(idle_agent)

    first = agents.submit(labels=busy_labels, config=SHORT_JOB)["job_id"]
    job_mid_run(orchestrator, first)
    assert admin_post(orchestrator, f"/api/admin/workers/{busy.id}/drain")["draining"] is True
    assert admin_post(orchestrator, f"/api/admin/workers/{idle.id}/drain")["draining"] is True

    busy_agent.wait_for_line(f"finishing job {first}, then taking no new job")
    job = job_in(orchestrator, first, "completed", "failed", "cancelled", timeout=JOB_DEADLINE_S)
    assert (job["status"], job["exit_code"]) == ("completed", 0)
    state = worker_when(orchestrator, busy.id, lambda w: w["current_job_id"] is None, message="busy worker freed")
    assert (state["status"], state["draining"]) == ("draining", True)
    busy_agent.wait_for_line("Draining: this worker takes no new jobs")

    second = agents.submit(labels=busy_labels, config=QUICK_JOB)
    assert (second["status"], second["dispatched"]) == ("queued", False)
    busy_agent.assert_keeps_running(NEGATIVE_WINDOW_S)
    job = orchestrator.job(second["job_id"])
    assert (job["status"], job["attempt_count"]) == ("queued", 0)
    assert "draining" in job["waiting_reason"]
    assert not busy_agent.has_line(second["job_id"])
    assert busy.state()["status"] == "draining"

    # The ephemeral agent, drained while idle, leaves.
    assert idle_agent.wait_exit(timeout=GRACEFUL_EXIT_S) == 0, idle_agent.describe()
    assert idle_agent.has_line("Disconnecting (ephemeral worker drained)")
    assert idle.state()["status"] == "offline"
    assert busy_agent.running()
    no_traceback(busy_agent)


# --- 7. token rotation ---------------------------------------------------------------------------------


def test_rotated_token_stops_the_agent_with_the_fix(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = agents.start(worker)
    agents.wait_ready(agent)

    rotated = admin_post(orchestrator, f"/api/admin/workers/{worker.id}/token")
    assert rotated["token"] != worker.token
    assert agent.wait_exit(timeout=PROMPT_EXIT_S) == 1, agent.describe()
    # The stream's shutdown event names the rotation; a heartbeat racing it gets a 401 that names it too.
    error = agent.lines()[agent.wait_for_line(re.compile(r"token rotated|token may have been rotated"), timeout=0)]
    assert re.search(r"Fix: .*request a new (token|one)", error), agent.describe()
    no_traceback(agent)


def test_rotating_a_busy_workers_token_is_refused_then_forced_without_spending_a_retry(orchestrator, fleet, agents):
    """Issue 14.2: the API names the running job (409) unless told to force; forced, the job goes back to
    the queue with its retries intact and runs to completion on the agent restarted with the new token."""
    pool = {"pool": fleet.tag}
    worker = fleet.create_worker(labels=pool)
    agent = agents.start(worker)
    agents.wait_ready(agent)
    job_id = agents.submit(labels=pool, config=LONG_JOB, max_retries=0)["job_id"]
    job_mid_run(orchestrator, job_id)

    refused = orchestrator.admin("POST", f"/api/admin/workers/{worker.id}/token")
    assert refused.status_code == 409, refused.text
    assert (refused.json()["code"], refused.json()["job_id"]) == ("worker_busy", job_id)
    assert orchestrator.job(job_id)["status"] == "running" and agent.running()

    forced = expect(orchestrator.admin("POST", f"/api/admin/workers/{worker.id}/token", json={"force": True}), 200)
    assert forced["requeued_job"] == job_id
    job = orchestrator.job(job_id)
    assert (job["status"], job["retry_count"], job["max_retries"]) == ("queued", 0, 0)
    assert [a["outcome"] for a in job["attempts"]] == ["interrupted"]
    assert agent.wait_exit(timeout=PROMPT_EXIT_S + 10) == 1, agent.describe()
    (requeued,) = orchestrator.audit(target_id=job_id, action="job.requeued")
    assert (requeued["details"]["retry_spent"], requeued["details"]["interrupted_by"]) == (False, "token rotation")

    worker.token = forced["token"]
    restarted = agents.start(worker)
    restarted.wait_for_line(f"Job {job_id} started: e2e-agent (attempt 2)")  # the requeued job, at once
    cancelled = admin_post(orchestrator, f"/api/queue/{job_id}/cancel")
    assert cancelled["status"] == "cancelled"
    no_traceback(agent)


# --- 8. the agent's own configuration errors -----------------------------------------------------------


def test_agent_configuration_errors(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag}, worker_type="ephemeral")
    no_url = agents.spawn(["--worker-token", "wt_" + "x" * 43, "--name", "no-url"], label="no-url")
    wrong_token = agents.spawn(
        ["--orchestrator-url", orchestrator.base_url, "--worker-token", "wt_" + "x" * 43, "--name", worker.name],
        label="wrong-token",
    )
    unreachable = agents.spawn(
        ["--orchestrator-url", f"http://127.0.0.1:{free_port()}", "--name", "unreachable"],
        label="unreachable",
        env=agents.env(SIMPLETUNER_WORKER_TOKEN=worker.token),
    )

    assert no_url.wait_exit() == 2, no_url.describe()
    (line,) = no_url.lines()
    assert line.startswith("simpletuner worker: error: no orchestrator URL") and "Fix: " in line, line

    assert wrong_token.wait_exit() == 1, wrong_token.describe()
    assert "invalid token" in wrong_token.lines()[-1] and "Fix: " in wrong_token.lines()[-1], wrong_token.describe()
    no_traceback(wrong_token)
    assert worker.state()["status"] == "connecting"  # never registered

    unreachable.wait_for_line(re.compile(r"Cannot register: .*connection refused.*retrying in \d+s"))
    unreachable.assert_keeps_running(2)
    unreachable.terminate()
    assert unreachable.wait_exit(timeout=PROMPT_EXIT_S) == 0, unreachable.describe()
    assert unreachable.has_line("Disconnecting (SIGTERM received)")
    no_traceback(unreachable)


# --- 9. SIGTERM while a job runs --------------------------------------------------------------------------


def test_sigterm_lets_the_job_finish_and_a_second_stops_it(orchestrator, fleet, agents):
    finish_labels = {"pool": fleet.tag, "role": "finish"}
    stop_labels = {"pool": fleet.tag, "role": "stop"}
    finishing = fleet.create_worker(labels=finish_labels)
    stopping = fleet.create_worker(labels=stop_labels)
    finishing_agent, stopping_agent = agents.start(finishing), agents.start(stopping)
    agents.wait_ready(finishing_agent)
    agents.wait_ready(stopping_agent)
    finished_job = agents.submit(labels=finish_labels, config=SHORT_JOB)["job_id"]
    stopped_job = agents.submit(labels=stop_labels, config=LONG_JOB)["job_id"]
    job_mid_run(orchestrator, finished_job)
    job_mid_run(orchestrator, stopped_job)

    # One signal: the job runs to its end and is reported, then the agent leaves.
    finishing_agent.terminate()
    stopping_agent.terminate()
    finishing_agent.wait_for_line(f"SIGTERM: finishing job {finished_job}, then exiting")
    stopping_agent.wait_for_line(f"SIGTERM: finishing job {stopped_job}, then exiting")
    # A second signal: the job stops now and the agent disconnects, handing the job back to the queue.
    stopping_agent.terminate()
    stopping_agent.wait_for_line(f"SIGTERM again: stopping job {stopped_job} now")

    job = job_in(orchestrator, finished_job, "completed", "failed", "cancelled", "queued", timeout=JOB_DEADLINE_S)
    assert (job["status"], job["exit_code"], job["attempt_count"]) == ("completed", 0, 1), job
    assert finishing_agent.wait_exit(timeout=GRACEFUL_EXIT_S) == 0, finishing_agent.describe()
    assert finishing_agent.has_line(f"Job {finished_job} completed in")
    assert finishing.state()["status"] == "offline"

    assert stopping_agent.wait_exit(timeout=GRACEFUL_EXIT_S) == 0, stopping_agent.describe()
    assert stopping_agent.has_line(f"Job {stopped_job} stopped after")
    job = orchestrator.job(stopped_job)
    assert job["status"] == "queued", job
    assert job["retry_count"] == 1
    (first,) = job["attempts"]  # disconnecting took the worker offline with the requeue: no dispatch back to it
    assert (first["worker_id"], first["outcome"]) == (stopping.id, "lost")
    assert "disconnected" in first["error"]
    assert "stopped by signal at step" in (stopping_agent.work_dir / stopped_job / "train.log").read_text()
    assert stopping.state()["status"] == "offline"
    assert not trainer_processes(stopping_agent.work_dir / stopped_job)


# --- graceful exit is prompt ------------------------------------------------------------------------------


def test_sigterm_while_idle_exits_promptly(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = agents.start(worker)
    agents.wait_ready(agent)

    agent.terminate()
    agent.wait_for_line("Disconnecting (SIGTERM received)")
    worker_when(orchestrator, worker.id, lambda w: w["status"] == "offline", message="worker offline")
    assert agent.wait_exit(timeout=PROMPT_EXIT_S) == 0, agent.describe()
    no_traceback(agent)


# --- exactly once under chaos: a result outlives its agent; stopping never waits on a dead orchestrator ----

TRAINER_START_LINE = "example trainer: logistic regression on"
# ~6 s: long enough that the link is always cut mid-run (progress is seen within ~1-2 s of the start).
CUT_JOB = {"max_train_steps": 60, "step_delay": 0.1, "checkpoint_every": 20}


def trainer_runs(job_dir):
    """Return how many times a trainer started in ``job_dir`` (each run appends to its train.log)."""
    try:
        return (job_dir / "train.log").read_text(errors="replace").count(TRAINER_START_LINE)
    except FileNotFoundError:
        return 0


def restart_and_see_it_completed_once(orchestrator, agents, agent, worker, job_id, attempt):
    """Start the next agent on ``agent``'s node; wait for the job to end: completed on its one attempt."""
    again = agents.again(agent, label=f"{agent.label}-again")
    job = job_in(orchestrator, job_id, "completed", "failed", "cancelled", "queued", timeout=JOB_DEADLINE_S)
    assert (job["status"], job["exit_code"], job["attempt_count"]) == ("completed", 0, 1), job
    assert [(a["lease_id"], a["outcome"], a["worker_id"]) for a in job["attempts"]] == [(attempt, "completed", worker.id)]
    assert "training complete: step 60" in job["log_tail"]
    return again


@pytest.mark.parametrize("death", ["kill -9", "SIGTERM"])
def test_result_of_a_finished_trainer_outlives_its_agent(orchestrator, fleet, agents, death):
    """The trainer finishes while the orchestrator cannot be reached; the agent dies holding the result
    (kill -9, or SIGTERM, which must not wait for the orchestrator). The next agent on the node reports
    the journaled result, with its attempt, before registering: the job completes, and never runs again."""
    labels = {"pool": fleet.tag}
    worker = fleet.create_worker(labels=labels)
    proxy = TcpProxy("127.0.0.1", orchestrator.port).start()
    try:
        agent = agents.start(worker, orchestrator_url=proxy.url)
        agents.wait_ready(agent)
        job_id = agents.submit(labels=labels, config=CUT_JOB)["job_id"]
        job_dir = agent.work_dir / job_id
        journal_path = job_dir / "outcome.json"

        mid = job_mid_run(orchestrator, job_id)
        (attempt,) = [a["lease_id"] for a in mid["attempts"]]
        proxy.cut()  # from here on nothing the agent sends reaches the orchestrator
        poll(journal_path.exists, timeout=JOB_DEADLINE_S, message=f"{journal_path} to be written")
        record = json.loads(journal_path.read_text())
        assert (record["job_id"], record["report"]["status"], record["report"]["attempt"]) == (job_id, "completed", attempt)
        assert record["report"]["exit_code"] == 0 and "training complete: step 60" in record["report"]["log_tail"]
        agent.wait_for_line(re.compile(rf"Could not report job {job_id} \("))
        assert orchestrator.job(job_id)["status"] == "running"  # the result is only on the node's disk

        if death == "kill -9":
            agent.kill()
        else:
            agent.terminate()
            assert agent.wait_exit(timeout=PROMPT_EXIT_S) == 0, agent.describe()
            agent.wait_for_line(f"Exiting without delivering the result of job {job_id}", timeout=0)
            assert not agent.has_line("Disconnecting"), agent.describe()  # the job stays this worker's
        assert journal_path.exists() and trainer_runs(job_dir) == 1
        proxy.heal()

        again = restart_and_see_it_completed_once(orchestrator, agents, agent, worker, job_id, attempt)
        reported = again.wait_for_line(f"Reported the result of job {job_id} (attempt {attempt}: completed) kept from before")
        registered = again.wait_for_line(f"Registered as {worker.name} ({worker.id})")
        assert reported < registered, again.describe()
        assert not journal_path.exists() and (job_dir / "outcome.reported.json").is_file()
        completed = [
            row for row in orchestrator.audit(target_id=job_id, action="job.status_changed") if row["details"]["to"] == "completed"
        ]
        assert [row["details"]["reason"] for row in completed] == [f"completed ({protocol.FROM_JOURNAL})"]

        # The node stays in service and runs nothing again.
        worker_when(orchestrator, worker.id, lambda w: (w["status"], w["current_job_id"]) == ("idle", None))
        again.assert_keeps_running(NEGATIVE_WINDOW_S)
        assert trainer_runs(job_dir) == 1
        job = orchestrator.job(job_id)
        assert (job["status"], job["attempt_count"]) == ("completed", 1)
        assert not orchestrator.audit(target_id=job_id, action="job.requeued")
        no_traceback(again)
    finally:
        proxy.stop()


def test_a_trainer_that_ends_as_its_agent_dies_is_reported_by_the_next_agent(orchestrator, fleet, agents):
    """The agent dies in the instant its trainer completes, before it could journal the result: frozen
    (SIGSTOP, so it cannot see the trainer end), the trainer completes, then kill -9. The trainer's
    supervisor recorded the exit; the next agent on the node journals and reports it before
    registering: the job completes on its one attempt, and its trainer never runs again."""
    labels = {"pool": fleet.tag}
    worker = fleet.create_worker(labels=labels)
    agent = agents.start(worker)
    agents.wait_ready(agent)
    job_id = agents.submit(labels=labels, config=CUT_JOB)["job_id"]
    job_dir = agent.work_dir / job_id
    mid = job_mid_run(orchestrator, job_id)
    (attempt,) = [a["lease_id"] for a in mid["attempts"]]

    agent.send_signal(signal.SIGSTOP)  # its threads freeze; the trainer and its supervisor run on
    try:
        exit_path = job_dir / supervisor.EXIT_FILE
        poll(exit_path.exists, timeout=JOB_DEADLINE_S, message=f"{exit_path} to be written")
        record = json.loads(exit_path.read_text())
        assert (record["job_id"], record["attempt"], record["returncode"], record["stopped_by_supervisor"]) == (
            job_id,
            attempt,
            0,
            False,
        )
        assert not (job_dir / "outcome.json").exists()  # the agent never saw the end
    finally:
        agent.kill()  # SIGKILL ends a stopped process too
    assert orchestrator.job(job_id)["status"] == "running"

    again = restart_and_see_it_completed_once(orchestrator, agents, agent, worker, job_id, attempt)
    again.wait_for_line(f"Job {job_id} (attempt {attempt}) completed while no agent watched")
    reported = again.wait_for_line(f"Reported the result of job {job_id} (attempt {attempt}: completed) kept from before")
    registered = again.wait_for_line(f"Registered as {worker.name} ({worker.id})")
    assert reported < registered, again.describe()
    assert not exit_path.exists() and (job_dir / supervisor.SETTLED_FILE).is_file()
    worker_when(orchestrator, worker.id, lambda w: (w["status"], w["current_job_id"]) == ("idle", None))
    again.assert_keeps_running(NEGATIVE_WINDOW_S)
    assert trainer_runs(job_dir) == 1
    assert not orchestrator.audit(target_id=job_id, action="job.requeued")
    no_traceback(again)


def unread_requests(server_port, client_pid):
    """Return how many of ``client_pid``'s connections to ``server_port`` hold bytes the server has not read.

    Read from the server's side of each connection in /proc/net/tcp (its receive queue): a stopped
    server leaves a request sent to it there.
    """
    client_ports = {
        c.laddr.port
        for c in psutil.Process(client_pid).net_connections(kind="tcp")
        if c.raddr and c.raddr.port == server_port
    }
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local_port = int(fields[1].rsplit(":", 1)[1], 16)
            remote_port = int(fields[2].rsplit(":", 1)[1], 16)
            rx_queue = int(fields[4].split(":")[1], 16)
            if local_port == server_port and remote_port in client_ports and rx_queue > 0:
                count += 1
    return count


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/net/tcp")
def test_sigterm_exits_promptly_while_the_orchestrator_does_not_answer(orchestrator, fleet, agents):
    """With the orchestrator stopped (SIGSTOP: connections open, nothing answered), a SIGTERM ends the
    agent within seconds even though a heartbeat is blocked waiting for its answer."""
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = agents.start(worker)
    agents.wait_ready(agent)

    server = psutil.Process(orchestrator.process.pid)
    server.suspend()
    try:
        poll(
            lambda: unread_requests(orchestrator.port, agent.pid),
            timeout=10,
            message="a heartbeat blocked on the stopped orchestrator",
        )
        started = time.monotonic()
        agent.terminate()
        assert agent.wait_exit(timeout=PROMPT_EXIT_S) == 0, agent.describe()
        took = time.monotonic() - started
    finally:
        server.resume()
    assert took < PROMPT_EXIT_S
    assert agent.has_line("Disconnecting (SIGTERM received)"), agent.describe()
    no_traceback(agent)


# --- issue 12: whatever bytes a trainer prints, its job ends ------------------------------------------------

# Prints NUL bytes, invalid UTF-8, a progress update with a NUL and the config's "last" line (<NUL> made a
# NUL byte), then exits with the config's "exit".
BYTES_TRAINER = r'''
import json, os, sys
config = json.load(open(os.environ["CONFIG_PATH"]))
out = sys.stdout.buffer
out.write(b"start\n")
out.write(b"nul:\x00:between\n")
out.write(b"bad utf8: \xff\xfe\xc3( end\n")
out.write(b'SIMPLETUNER_PROGRESS {"step": 2, "total_steps": 2, "message": "m\\u0000x"}\n')
out.write(config.get("last", "done").replace("<NUL>", "\0").encode() + b"\n")  # a config holds no NUL
out.flush()
sys.exit(config.get("exit", 0))
'''


@pytest.fixture
def bytes_trainer(tmp_path):
    script = tmp_path / "bytes_trainer.py"
    script.write_text(BYTES_TRAINER)
    return f"{sys.executable} {script}"


def test_trainer_printing_nul_and_invalid_utf8_completes_with_its_log(orchestrator, fleet, agents, bytes_trainer):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = agents.start(worker, extra_args=("--command", bytes_trainer))
    agents.wait_ready(agent)

    job_id = agents.submit(labels={"pool": fleet.tag}, config={"exit": 0})["job_id"]

    job = job_in(orchestrator, job_id, "completed", "failed", "cancelled", timeout=JOB_DEADLINE_S)
    assert (job["status"], job["exit_code"]) == ("completed", 0), job
    # Output is text (docs/agent-guide.md): the agent drops control characters (the NUL), the orchestrator stores
    # what cannot be decoded as U+FFFD.
    assert job["log_tail"] == "start\nnul::between\nbad utf8: \ufffd\ufffd\ufffd( end\ndone"
    assert job["progress"] == {"step": 2, "total_steps": 2, "fraction": 1.0, "message": "mx"}
    assert [a["outcome"] for a in job["attempts"]] == ["completed"]
    worker_when(orchestrator, worker.id, lambda w: (w["status"], w["current_job_id"]) == ("idle", None))
    assert not agent.has_line("rejected")
    no_traceback(agent)


def test_failed_report_with_a_nul_in_its_reason_ends_failed_not_running(orchestrator, fleet, agents, bytes_trainer):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = agents.start(worker, extra_args=("--command", bytes_trainer))
    agents.wait_ready(agent)

    job_id = agents.submit(labels={"pool": fleet.tag}, config={"exit": 3, "last": "RuntimeError: bad<NUL>byte"})["job_id"]

    job = job_in(orchestrator, job_id, "completed", "failed", "cancelled", timeout=JOB_DEADLINE_S)
    assert (job["status"], job["exit_code"]) == ("failed", 3), job
    assert job["last_error"] == "Training exited with code 3: RuntimeError: badbyte"
    assert job["log_tail"].endswith("bad utf8: \ufffd\ufffd\ufffd( end\nRuntimeError: badbyte")
    assert [(a["outcome"], a["error"]) for a in job["attempts"]] == [("failed", job["last_error"])]
    worker_when(orchestrator, worker.id, lambda w: (w["status"], w["current_job_id"]) == ("idle", None))
    agent.wait_for_line(f"Job {job_id} failed after")
    assert not agent.has_line("rejected")
    no_traceback(agent)


def test_the_whole_log_of_a_job_reaches_the_orchestrator(orchestrator, fleet, agents):
    """Issue 14.6: every line the trainer printed (progress lines aside) is in the job's log, once, in order."""
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = agents.start(worker)
    agents.wait_ready(agent)
    many_lines = {"max_train_steps": 240, "step_delay": 0.01, "checkpoint_every": 2}  # a line per checkpoint
    job_id = agents.submit(labels={"pool": fleet.tag}, config=many_lines)["job_id"]
    job_in(orchestrator, job_id, "completed", timeout=JOB_DEADLINE_S)

    printed = [
        line.rstrip()
        for line in (agent.work_dir / job_id / "train.log").read_text().splitlines()
        if line.strip() and not line.startswith("SIMPLETUNER_PROGRESS")
    ]
    assert len(printed) > 100  # more than the 50-line tail holds
    response = orchestrator.admin("GET", f"/api/queue/{job_id}/log")
    assert response.status_code == 200
    text = response.text
    header = f"# --- attempt 1 on {worker.name} (completed): {len(printed)} line(s) ---\n"
    assert header in text
    assert text.split(header, 1)[1] == "".join(f"{line}\n" for line in printed)
