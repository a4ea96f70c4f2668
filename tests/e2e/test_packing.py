"""Several jobs on one worker (issue 30): a real agent with declared GPU slots (``--gpus``) against a real
orchestrator, over HTTP, on SQLite and on PostgreSQL + Redis."""

import json
import shlex
import sys
from pathlib import Path

import pytest

from .agent_harness import job_in, worker_when
from .harness import poll

pytestmark = pytest.mark.e2e

GPU_TRAINER = shlex.join([sys.executable, str(Path(__file__).with_name("gpu_trainer.py"))])
JOB_DEADLINE_S = 60


def packing_agent(agents, worker, gpus="0,1,2,3"):
    agent = agents.start(worker, extra_args=["--gpus", gpus, "--command", GPU_TRAINER])
    agents.wait_ready(agent)
    return agent


def submit(agents, fleet, barrier, name, *, gpu_count, peers=0, hold_s=0):
    config = {"barrier_dir": str(barrier), "name": name, "peers": peers, "hold_s": hold_s}
    body = {"labels": {"pool": fleet.tag}, "config": config}
    if gpu_count is not None:
        body["gpu_count"] = gpu_count
    return agents.submit(**body)["job_id"]


def recorded(barrier):
    return {path.stem: json.loads(path.read_text()) for path in barrier.glob("*.json")}


def completed(orchestrator, job_ids):
    jobs = [job_in(orchestrator, job_id, "completed", "failed", "cancelled", timeout=JOB_DEADLINE_S) for job_id in job_ids]
    assert [job["status"] for job in jobs] == ["completed"] * len(jobs), jobs
    return jobs


def test_four_one_gpu_jobs_run_at_once_on_a_four_gpu_worker(orchestrator, fleet, agents, tmp_path):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = packing_agent(agents, worker)
    state = worker.state()
    assert (state["gpu_count"], state["gpus_free"]) == (4, 4), state

    barrier = tmp_path / "barrier"
    barrier.mkdir()
    job_ids = [submit(agents, fleet, barrier, f"job{n}", gpu_count=1, peers=4, hold_s=2) for n in range(4)]

    # All four run at once (each trainer waits for the other three): the worker is full and busy meanwhile.
    busy = worker_when(orchestrator, worker.id, lambda w: w["gpus_free"] == 0 and len(w["running_jobs"]) == 4, timeout=30)
    assert busy["status"] == "busy"
    assert sorted(index for job in busy["running_jobs"] for index in job["gpu_indices"]) == [0, 1, 2, 3]
    jobs = completed(orchestrator, job_ids)

    seen = recorded(barrier)
    devices = sorted(entry["cuda_visible_devices"] for entry in seen.values())
    assert devices == ["0", "1", "2", "3"], seen
    for entry in seen.values():
        assert entry["accelerate_visible_devices"] == entry["cuda_visible_devices"]
        assert entry["num_processes"] == 1
    assert sorted(str(index) for job in jobs for index in job["gpu_indices"]) == devices
    worker_when(orchestrator, worker.id, lambda w: (w["status"], w["gpus_free"], w["running_jobs"]) == ("idle", 4, []))
    assert "Traceback" not in agent.output(), agent.describe()


def test_a_two_gpu_job_and_two_one_gpu_jobs_share_a_worker(orchestrator, fleet, agents, tmp_path):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    packing_agent(agents, worker)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    job_ids = [
        submit(agents, fleet, barrier, "wide", gpu_count=2, peers=3, hold_s=1),
        submit(agents, fleet, barrier, "one", gpu_count=1, peers=3, hold_s=1),
        submit(agents, fleet, barrier, "two", gpu_count=1, peers=3, hold_s=1),
    ]
    completed(orchestrator, job_ids)
    seen = recorded(barrier)
    wide = seen["wide"]["cuda_visible_devices"].split(",")
    assert len(wide) == 2 and seen["wide"]["num_processes"] == 2
    used = wide + [seen["one"]["cuda_visible_devices"], seen["two"]["cuda_visible_devices"]]
    assert len(set(used)) == 4 and set(used) <= {"0", "1", "2", "3"}, seen


def test_a_job_without_gpu_count_waits_for_the_whole_worker(orchestrator, fleet, agents, tmp_path):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    packing_agent(agents, worker)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    small = [submit(agents, fleet, barrier, f"small{n}", gpu_count=1, peers=2, hold_s=3) for n in range(2)]
    poll(lambda: len(recorded(barrier)) == 2, timeout=30, message="both one-GPU jobs to run")
    whole = submit(agents, fleet, barrier, "whole", gpu_count=None)

    waiting = orchestrator.job(whole)
    assert waiting["status"] == "queued", waiting  # two GPUs are free, but it wants the whole worker
    jobs = completed(orchestrator, [*small, whole])
    assert jobs[2]["dispatched_at"] >= max(job["finished_at"] for job in jobs[:2])
    assert recorded(barrier)["whole"]["cuda_visible_devices"] is None  # the whole worker, as today
