"""Resume from checkpoint, end to end: a real orchestrator (``simpletuner server``, sweeps on), real agents and
the example trainer. The first agent is killed -9 after its second checkpoint; the job completes on a second
agent that starts from the last checkpoint the first attempt completed, and its final artifact downloads
with the SHA-256 the orchestrator recorded. Then a trainer that marks its checkpoints as SimpleTuner's does
and uploads nothing (``guard_trainer.py``): the agent uploads them as they are finished, a killed node's
job resumes from the newest, and a job whose newest checkpoint is its final step is not trained again."""

import hashlib
import json
import re
import shlex
import sys
from pathlib import Path

import pytest
import requests
from django.core import signing

from artifacts import tokens
from worker_agent import protocol

from .agent_harness import job_in, trainer_processes
from .guard_trainer import weights_after
from .harness import poll
from .interop import BACKENDS, completed_steps, job_dir_of, kill_node, run_agents, serve

pytestmark = pytest.mark.e2e

# ~6 s uninterrupted: 60 steps of 0.1 s, a checkpoint every 10 steps, each published by the trainer.
RESUMABLE_JOB = {"max_train_steps": 60, "step_delay": 0.1, "checkpoint_every": 10, "seed": 5, "learning_rate": 0.05}
FAST_SWEEPS = {
    "SIMPLETUNER_HEARTBEAT_TIMEOUT": "3",
    "SIMPLETUNER_HEALTH_CHECK_INTERVAL": "1",
    "SIMPLETUNER_DISPATCH_ACK_TIMEOUT": "10",
}


@pytest.fixture(params=BACKENDS)
def server(request, tmp_path):
    yield from serve(request, tmp_path, FAST_SWEEPS)


@pytest.fixture
def runner(server, tmp_path):
    yield from run_agents(server, tmp_path, "resume")


def published_steps(job_dir):
    log = (job_dir / "train.log").read_text(errors="replace") if (job_dir / "train.log").exists() else ""
    return [int(step) for step in re.findall(r"checkpoint-(\d+) published", log)]


def upload_token_of(server, lease_id):
    """The token the orchestrator gave attempt ``lease_id`` (signed with its data dir's secret key)."""
    key = (server.data_dir / "secret_key").read_text().strip()
    return tokens.PREFIX + signing.Signer(key=key, salt=tokens._SALT).sign(lease_id)


def test_a_job_killed_after_its_second_checkpoint_resumes_on_another_agent(server, runner):
    tag = runner.fleet.tag
    first_worker = runner.fleet.create_worker(labels={"pool": tag})
    first = runner.start(first_worker)
    runner.wait_ready(first)
    job_id = runner.submit(labels={"pool": tag}, config=RESUMABLE_JOB)["job_id"]
    job_dir = first.work_dir / job_id

    poll(lambda: len(published_steps(job_dir)) >= 2, timeout=30, message="the second checkpoint to be published")
    first.kill()  # kill -9: the trainer follows it (parent-death signal), nothing is reported
    poll(lambda: not trainer_processes(job_dir, supervisors=True), timeout=15, message="the first trainer to be gone")
    resumed_from = max(published_steps(job_dir))
    assert resumed_from >= 20
    first_lease = server.job(job_id)["attempts"][0]["lease_id"]

    second_worker = runner.fleet.create_worker(labels={"pool": tag})
    second = runner.start(second_worker)
    runner.wait_ready(second)
    job = job_in(server, job_id, "completed", "failed", "cancelled", timeout=60)

    assert job["status"] == "completed", job
    first_attempt, second_attempt = job["attempts"]
    assert first_attempt["outcome"] == "lost" and second_attempt["worker_id"] == second_worker.id
    assert second_attempt["start_step"] == resumed_from
    assert first_attempt["start_step"] == 0 and first_attempt["reached_step"] >= resumed_from  # its checkpoint proves it
    assert second_attempt["reached_step"] == RESUMABLE_JOB["max_train_steps"]
    second_log = (second.work_dir / job_id / "train.log").read_text()
    assert f"resumed from checkpoint-{resumed_from} at step {resumed_from}" in second_log
    assert "step 10/60" not in second_log  # it did not start over
    second.wait_for_line(f"job {job_id}: resuming from checkpoint-{resumed_from}", timeout=0)

    artifacts = {a["key"]: a for a in job["artifacts"]}
    final = artifacts["output/checkpoint.json"]
    assert final["attempt"] == 2
    assert f"output/checkpoint-{resumed_from}/checkpoint.json" in artifacts
    response = server.admin("GET", final["download_url"].removeprefix(server.base_url))  # an absolute URL
    assert response.status_code == 200
    assert hashlib.sha256(response.content).hexdigest() == final["sha256"] == response.headers["X-Checksum-SHA256"]
    assert (json.loads(response.content)["step"], json.loads(response.content)["complete"]) == (60, True)

    # The lost attempt's token is dead; one that was never issued is unknown.
    url = server.url(f"{protocol.UPLOAD_PATH}/output/late.bin")
    stale = requests.put(url, data=b"late", headers={protocol.UPLOAD_TOKEN_HEADER: upload_token_of(server, first_lease)}, timeout=10)
    forged = requests.put(url, data=b"late", headers={protocol.UPLOAD_TOKEN_HEADER: "stu_" + first_lease + ":forged"}, timeout=10)
    assert (stale.status_code, stale.json()["code"]) == (409, protocol.STALE_ATTEMPT)
    assert (forged.status_code, forged.json()["code"]) == (401, protocol.NOT_AUTHENTICATED)


# --- a trainer that marks its checkpoints as SimpleTuner's does, and uploads nothing ----------------------

GUARD_TRAINER = shlex.join([sys.executable, str(Path(__file__).with_name("guard_trainer.py"))])
GUARDED_JOB = {"max_train_steps": 8, "checkpoint_every": 2, "step_delay": 0.05, "seed": 3}


def test_marked_checkpoints_leave_the_node_and_a_killed_job_resumes_from_the_newest_with_the_same_weights(server, runner):
    """The agent uploads each checkpoint the trainer marks complete while it runs; the node killed after
    checkpoint-4 (the trainer pausing there), the job resumes from it on another agent and ends with the
    weights of an uninterrupted run."""
    pool = {"pool": runner.fleet.tag}
    first = runner.start(runner.fleet.create_worker(labels=pool), extra_args=("--command", GUARD_TRAINER))
    runner.wait_ready(first)
    job_id = runner.submit(labels=pool, config={**GUARDED_JOB, "pause_after": [4, 60]})["job_id"]
    job_dir = job_dir_of(first, job_id)

    poll(lambda: (server.job(job_id)["attempts"][0]["lease_id"], 4) in completed_steps(server, job_id), timeout=30,
         message="checkpoint-4 held complete")  # fmt: skip
    assert {step for _, step in completed_steps(server, job_id)} == {2, 4}
    kill_node(first, job_dir)
    second = runner.start(runner.fleet.create_worker(labels=pool), extra_args=("--command", GUARD_TRAINER))
    job = job_in(server, job_id, "completed", "failed", "cancelled", timeout=60)

    assert job["status"] == "completed", job
    lost, resumed = job["attempts"]
    assert (lost["outcome"], resumed["worker_id"], resumed["start_step"]) == ("lost", second.worker.id, 4)
    assert "resumed from checkpoint-4 at step 4" in (job_dir_of(second, job_id) / "train.log").read_text()
    artifacts = {a["key"]: a for a in job["artifacts"]}
    for step in (2, 4, 6, 8):  # marker included; 6 and 8 by the second attempt
        assert artifacts[f"output/checkpoint-{step}/.guard"]["attempt"] == (1 if step <= 4 else 2)
    final = artifacts["output/model.safetensors"]
    assert final["sha256"] == hashlib.sha256(weights_after(8, seed=3)).hexdigest()
    assert {(lease, step) for lease, step in completed_steps(server, job_id) if lease == resumed["lease_id"]} == {
        (resumed["lease_id"], 6), (resumed["lease_id"], 8),
    }  # fmt: skip
    rows = server.audit(action="checkpoint.completed", target_id=job_id)
    assert all(row["details"].get("declared") for row in rows)  # by the agent's declaration, never by a heartbeat


def test_a_job_whose_newest_checkpoint_is_its_final_step_is_not_trained_again(server, runner):
    pool = {"pool": runner.fleet.tag}
    first = runner.start(runner.fleet.create_worker(labels=pool), extra_args=("--command", GUARD_TRAINER))
    runner.wait_ready(first)
    job_id = runner.submit(labels=pool, config={**GUARDED_JOB, "pause_after": [8, 60]})["job_id"]
    job_dir = job_dir_of(first, job_id)
    poll(lambda: 8 in {step for _, step in completed_steps(server, job_id)}, timeout=30, message="checkpoint-8 held complete")
    kill_node(first, job_dir)

    second = runner.start(runner.fleet.create_worker(labels=pool), extra_args=("--command", GUARD_TRAINER))
    job = job_in(server, job_id, "completed", "failed", "cancelled", timeout=60)

    assert job["status"] == "completed", job
    assert [a["start_step"] for a in job["attempts"]] == [0, 8] and job["attempts"][1]["reached_step"] == 8
    second.wait_for_line(f"job {job_id}: checkpoint-8 is this run's final step (max_train_steps): not trained again", timeout=0)
    assert not (job_dir_of(second, job_id) / "train.log").exists()  # no trainer ran
    artifacts = {a["key"]: a for a in job["artifacts"]}
    final = artifacts["output/model.safetensors"]
    assert final["attempt"] == 2 and final["sha256"] == artifacts["output/checkpoint-8/model.safetensors"]["sha256"]
    assert final["sha256"] == hashlib.sha256(weights_after(8, seed=3)).hexdigest()


# --- the upstream agent's pair, and a large upload with bounded memory --------------------------------


def test_the_upstream_agent_gets_a_working_upload_endpoint_and_token(server, runner):
    """What SimpleTuner's own agent does with ``job_submit``: SIMPLETUNER_UPLOAD_ENDPOINT is the server's URL
    joined to ``upload_endpoint``, the trainer PUTs ``{endpoint}/{bucket}/{key}`` with the token."""
    fleet = runner.fleet
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    worker.register({"name": worker.name, "worker_id": worker.id, "gpu_info": {"name": "cpu", "count": 0}, "persistent": True})
    stream = fleet.open_stream(worker)
    job_id = fleet.submit({"config_name": "upstream", "config": {"x": 1}, "worker_labels": {"pool": fleet.tag}})["job_id"]
    data = stream.wait_for("job_submit").json()
    worker.report(job_id, "starting")
    endpoint = f"{server.base_url}{data['upload_endpoint']}"  # as simpletuner/worker_agent.py builds it

    first = requests.put(f"{endpoint}/simpletuner-outputs/{job_id}/pytorch_lora_weights.safetensors", data=b"lora",
                         headers={"X-SimpleTuner-Secret": data["upload_token"]}, timeout=10)  # fmt: skip
    again = requests.put(f"{endpoint}/simpletuner-outputs/{job_id}/pytorch_lora_weights.safetensors", data=b"lora2",
                         headers={"X-Upload-Token": data["upload_token"]}, timeout=10)  # fmt: skip
    climbing = requests.put(f"{endpoint}/simpletuner-outputs/a/%2E%2E/b", data=b"x", headers={"X-Upload-Token": data["upload_token"]}, timeout=10)

    assert (first.status_code, again.status_code) == (201, 200)
    assert first.json()["ETag"] == first.headers["ETag"]
    assert climbing.status_code in (400, 404)
    (artifact,) = server.job(job_id)["artifacts"]
    assert artifact["key"] == f"simpletuner-outputs/{job_id}/pytorch_lora_weights.safetensors"
    assert artifact["sha256"] == hashlib.sha256(b"lora2").hexdigest()


class Generated:
    """A body of ``size`` bytes made on the fly (Content-Length from __len__)."""

    def __init__(self, size):
        self.left, self.digest = size, hashlib.sha256()

    def __len__(self):
        return self.left

    def read(self, n=-1):
        n = min(self.left, 1 << 20 if n is None or n < 0 else min(n, 1 << 20))
        self.left -= n
        data = b"\x5a" * n
        self.digest.update(data)
        return data


def test_a_large_upload_streams_with_bounded_server_memory(server, runner):
    """256 MiB through ``simpletuner server``: its RSS grows by far less than the body (daphne alone: all of it)."""
    import threading

    import psutil

    fleet = runner.fleet
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    worker.register({"name": worker.name, "worker_id": worker.id, "gpu_info": {"name": "cpu", "count": 0}, "persistent": True})
    stream = fleet.open_stream(worker)
    job_id = fleet.submit({"config_name": "big", "config": {}, "worker_labels": {"pool": fleet.tag}})["job_id"]
    token = stream.wait_for("job_submit").json()["upload_token"]
    worker.report(job_id, "starting")
    process = psutil.Process(server.process.pid)
    baseline = process.memory_info().rss
    peak, stop = [baseline], threading.Event()

    def sample():
        beat = 0
        while not stop.wait(0.02):
            peak.append(process.memory_info().rss)
            beat += 1
            if beat % 25 == 0:  # the attempt stays alive while it uploads (SIMPLETUNER_HEARTBEAT_TIMEOUT is 3 s here)
                worker.heartbeat({"worker_id": worker.id, "status": "busy", "current_job_id": job_id})

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    body = Generated(256 << 20)
    try:
        response = requests.put(server.url(f"{protocol.UPLOAD_PATH}/output/big.bin"), data=body,
                                headers={protocol.UPLOAD_TOKEN_HEADER: token}, timeout=300)  # fmt: skip
    finally:
        stop.set()
        sampler.join()

    assert response.status_code == 201, response.text
    assert response.json()["sha256"] == body.digest.hexdigest() and response.json()["size"] == 256 << 20
    assert max(peak) - baseline < 64 << 20, f"the server grew by {(max(peak) - baseline) >> 20} MiB"
