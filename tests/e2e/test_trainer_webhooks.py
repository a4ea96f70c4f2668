"""A trainer that reports only through webhooks, as SimpleTuner's does, run by a real agent for a real orchestrator:
its progress, stages and errors reach the job; its coloured output arrives as text; a forged post is refused."""

import json
import shlex
import sys
from pathlib import Path

import pytest
import requests

from .agent_harness import job_in, job_when

pytestmark = pytest.mark.e2e

TRAINER = shlex.join([sys.executable, str(Path(__file__).with_name("webhook_trainer.py"))])
JOB_DEADLINE_S = 60
OSERROR = "We couldn't connect to 'https://huggingface.co' to load this model"


def test_a_webhook_trainers_progress_stages_and_failure_reach_the_job(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = agents.start(worker, extra_args=["--command", TRAINER])
    agents.wait_ready(agent)

    users_hook = {"webhook_type": "discord", "webhook_url": "https://discord.invalid/hook"}
    config = {"fake_events": "run", "fake_step_delay": 1.0, "--webhook_config": users_hook}  # ~10 s of steps to look at
    job_id = agents.submit(labels={"pool": fleet.tag}, config=config)["job_id"]

    # While it trains: step, total, percent, loss, learning rate, ETA and the stage, in the API.
    mid = job_when(
        orchestrator, job_id, lambda job: job["status"] == "running" and 1 <= (job["progress"] or {}).get("step", 0) < 6,
        timeout=JOB_DEADLINE_S, message="a training step before the last in the job's progress",
    )  # fmt: skip
    progress = mid["progress"]
    assert progress["total_steps"] == 6 and 0 < progress["fraction"] < 1
    assert progress["fraction"] == pytest.approx(progress["step"] / 6)
    assert isinstance(progress["loss"], float) and progress["learning_rate"] == pytest.approx(0.0001)
    assert progress["eta_seconds"] >= 0
    assert progress["stage"]["label"] in ("Training", "Saving Checkpoint")

    # Nothing else on the node can post to the job's receiver: not without its path and key.
    job_dir = agent.work_dir / job_id
    hooks = json.loads((job_dir / "config.json").read_text())["--webhook_config"]
    assert hooks[0] == users_hook and hooks[1]["webhook_type"] == "raw"
    url = hooks[1]["callback_url"]
    forged = {"type": "training.status", "progress": {"current": 5, "total": 6, "metrics": {"loss": 99.0}}}
    assert requests.post(url, json=forged, timeout=5).status_code == 403
    assert requests.post(url.rsplit("/", 1)[0] + "/guess", json=forged, headers={"X-API-Key": hooks[1]["auth_token"]}, timeout=5).status_code == 403

    job = job_in(orchestrator, job_id, "completed", "failed", timeout=JOB_DEADLINE_S)
    assert job["status"] == "completed", job
    assert (job["progress"]["step"], job["progress"]["total_steps"], job["progress"]["fraction"]) == (6, 6, 1.0)
    assert job["progress"]["loss"] == pytest.approx(1.0546059608459473)  # the trainer's, never the forged 99
    assert job["progress"]["stage"]["key"] == "training_complete"
    log = orchestrator.admin("GET", f"/api/queue/{job_id}/log").text
    assert "[stage] Saving Checkpoint: running - Saving checkpoint to" in log
    assert "[stage] Training Complete: completed - Training run complete." in log
    assert "\x1b" not in log and "INFO fake trainer: run, 1 raw webhook(s)" in log
    assert agent.has_line(f"Job {job_id}: Saving Checkpoint: running")  # the agent's own log says it too

    # A crash: the trainer's own error event is the reason, the coloured output arrives as text.
    failed_id = agents.submit(labels={"pool": fleet.tag}, config={"fake_events": "failure"}, max_retries=0)["job_id"]
    failed = job_in(orchestrator, failed_id, "completed", "failed", timeout=JOB_DEADLINE_S)
    assert failed["status"] == "failed", failed
    assert failed["last_error"].startswith(f"Training exited with code 1: Training failed: OSError: {OSERROR}"), failed["last_error"]
    assert failed["progress"]["stage"] == {"key": "training", "label": "Training", "status": "failed"}
    assert "\x1b" not in failed["log_tail"] and failed["log_tail"].splitlines()[-1] == f"OSError: {OSERROR}"

    # The same crash from a trainer that posts nothing: its coloured traceback's exception is the reason.
    silent_id = agents.submit(labels={"pool": fleet.tag}, config={"fake_events": "failure", "fake_silent": True}, max_retries=0)["job_id"]
    silent = job_in(orchestrator, silent_id, "completed", "failed", timeout=JOB_DEADLINE_S)
    assert silent["last_error"] == f"Training exited with code 1: OSError: {OSERROR}", silent["last_error"]
    assert "\x1b" not in silent["log_tail"] and silent["progress"] in (None, {})
