"""Jobs across machines (issue 30, gangs): real agents (one declared GPU each, ``--advertise-address 127.0.0.1``)
against a real orchestrator with its sweeps and short timers, over HTTP, on SQLite and on PostgreSQL + Redis."""

import importlib.util
import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from . import interop
from .agent_harness import job_in, worker_when
from .harness import poll
from .test_faults import LOST_DEADLINE_S, TERMINAL, backend, blocker_dir, server, stage  # noqa: F401 (fixtures)

pytestmark = pytest.mark.e2e

GANG_TRAINER_PATH = str(Path(__file__).with_name("gang_trainer.py"))
GANG_TRAINER = shlex.join([sys.executable, GANG_TRAINER_PATH])
JOB_DEADLINE_S = 60


def _torch_python():
    """A Python that imports torch: this one, else SimpleTuner's venv (``make interop``'s, when it is built); or None."""
    if importlib.util.find_spec("torch") is not None:
        return sys.executable
    if interop.PEER_PYTHON.exists():
        probe = subprocess.run([str(interop.PEER_PYTHON), "-c", "import torch.distributed"], capture_output=True, timeout=120)
        if probe.returncode == 0:
            return str(interop.PEER_PYTHON)
    return None


TORCH_PYTHON = _torch_python()


def members(stage, n, *, command=GANG_TRAINER):
    """``n`` workers whose agents run multi-node members, each with one declared GPU, connected."""
    workers = [stage.worker() for _ in range(n)]
    args = ["--gpus", "0", "--advertise-address", "127.0.0.1", "--command", command]
    agents = [stage.agents.start(worker, extra_args=args) for worker in workers]
    for agent in agents:
        stage.agents.wait_ready(agent)
    return workers, agents


def submit(stage, barrier, name, *, num_nodes=2, **config):
    return stage.submit({"barrier_dir": str(barrier), "name": name, **config}, num_nodes=num_nodes, gpu_count=1)


def recorded(barrier, name):
    return [json.loads(path.read_text()) for path in sorted(barrier.glob(f"{name}-rank*.json"))]


def _two_node_job(server, stage, tmp_path, *, name, torch=False):
    """Run a two-node job on two agents; return it and what each member recorded, rank 0 first."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    workers, agents = members(stage, 2, command=shlex.join([TORCH_PYTHON, GANG_TRAINER_PATH]) if torch else GANG_TRAINER)
    job_id = submit(stage, barrier, name, torch=torch)
    job = job_in(server, job_id, *TERMINAL, timeout=JOB_DEADLINE_S)
    assert job["status"] == "completed", job
    assert (job["attempt_count"], job["retry_count"]) == (1, 0)
    assert [(m["rank"], m["outcome"]) for m in job["members"]] == [(0, "completed"), (1, "completed")]
    assert {m["worker_id"] for m in job["members"]} == {w.id for w in workers}
    for agent in agents:  # each member ran exactly once
        assert len(agent.lines_matching(f"Job {job_id} started")) == 1, agent.describe()
    return job, sorted(recorded(barrier, name), key=lambda entry: entry["rank"])


def test_a_two_node_job_proves_its_rendezvous_and_completes_once(server, stage, tmp_path):
    job, seen = _two_node_job(server, stage, tmp_path, name="pair")
    assert [(e["rank"], e["heard"]) for e in seen] == [(0, [1]), (1, [0])], seen
    for entry in seen:
        assert (entry["master_addr"], entry["master_port"]) == ("127.0.0.1", job["master_port"])
        assert (entry["num_machines"], entry["machine_rank"], entry["same_network"]) == (2, entry["rank"], True)
        assert (entry["main_process_ip"], entry["main_process_port"]) == ("127.0.0.1", job["master_port"])


@pytest.mark.skipif(TORCH_PYTHON is None, reason="no Python with torch here (nor SimpleTuner's venv): no gloo all-reduce")
def test_a_two_node_job_runs_a_torch_distributed_gloo_all_reduce(server, stage, tmp_path):
    _, seen = _two_node_job(server, stage, tmp_path, name="gloo", torch=True)
    assert [e["all_reduce"] for e in seen] == [1.0, 1.0], seen  # 0 + 1, summed across the two agents


def test_killing_one_members_agent_stops_the_other_and_the_job_completes_on_the_retry(server, stage, tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    (barrier / "hold").write_text("")  # the members wait after their rendezvous until the test lets them go
    workers, agents = members(stage, 3)
    agent_of = {worker.id: agent for worker, agent in zip(workers, agents)}
    job_id = submit(stage, barrier, "lost")
    job = poll(lambda: (lambda j: j if j["status"] == "running" else None)(server.job(job_id)), timeout=30,
               message="the gang to run (both members acknowledged)")
    rank0, rank1 = (m["worker_id"] for m in job["members"])
    agent_of[rank1].kill()  # SIGKILL: only the heartbeat timeout tells
    requeued = poll(lambda: (lambda j: j if j["retry_count"] == 1 else None)(server.job(job_id)),
                    timeout=LOST_DEADLINE_S, message="the gang requeued")
    assert requeued["attempts"][0]["outcome"] == "lost", requeued
    # The other member was told to stop: its agent ends its trainer (it never got past the hold).
    agent_of[rank0].wait_for_line(f"Job {job_id} cancelled by the orchestrator", timeout=LOST_DEADLINE_S)
    assert recorded(barrier, "lost") == []
    (barrier / "hold").unlink()
    job = job_in(server, job_id, *TERMINAL, timeout=JOB_DEADLINE_S)
    assert (job["status"], job["attempt_count"], job["retry_count"]) == ("completed", 2, 1), job
    assert rank1 not in {m["worker_id"] for m in job["members"]}  # the retry's members: the two agents alive
    assert worker_when(server, rank1, lambda w: w["status"] == "offline")["current_job_id"] is None
    finished = recorded(barrier, "lost")
    assert sorted(e["rank"] for e in finished) == [0, 1], finished  # only the retry's members got past the hold


def test_two_gangs_and_a_one_node_job_on_three_workers_never_deadlock(server, stage, tmp_path):
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    (barrier / "hold").write_text("")
    workers, _ = members(stage, 3)
    first = submit(stage, barrier, "first")
    second = submit(stage, barrier, "second")
    single = stage.submit({"barrier_dir": str(barrier), "name": "single"}, gpu_count=1)
    poll(lambda: server.job(first)["status"] == "running", timeout=30, message="the first gang to run")
    job = server.job(single)
    assert job["status"] in ("dispatched", "running", "completed"), job  # the third worker took it
    waiting = server.job(second)
    assert waiting["status"] == "queued", waiting
    assert waiting["waiting_reason"].startswith("needs 2 workers with ≥ 1 free GPU matching pool="), waiting
    (barrier / "hold").unlink()
    for job_id in (first, second):
        job = job_in(server, job_id, *TERMINAL, timeout=JOB_DEADLINE_S)
        assert (job["status"], job["attempt_count"]) == ("completed", 1), job
    assert job_in(server, single, *TERMINAL, timeout=JOB_DEADLINE_S)["status"] in ("completed", "failed")


def test_a_two_node_job_runs_beside_the_one_gpu_job_each_packing_agent_runs(server, stage, tmp_path):
    """Two agents with two declared GPUs each (``--gpus 0,1``: they pack), each running a long one-GPU job on GPU 0:
    a two-node job needing one GPU per node runs beside them, a member on each agent's free GPU, and completes once."""
    long_barrier, gang_barrier = tmp_path / "long", tmp_path / "gang"
    long_barrier.mkdir()
    gang_barrier.mkdir()
    (long_barrier / "hold").write_text("")  # the one-node jobs run until the test lets them go
    workers = [stage.worker() for _ in range(2)]
    args = ["--gpus", "0,1", "--advertise-address", "127.0.0.1", "--command", GANG_TRAINER]
    agents = stage.start(*workers, extra_args=args)
    for worker in workers:
        state = worker_when(server, worker.id, lambda w: w["gpus_free"] == 2)
        assert state["gpu_count"] == 2, state
    long = [submit(stage, long_barrier, f"long{n}", num_nodes=1) for n in range(2)]
    for job_id in long:
        poll(lambda job_id=job_id: server.job(job_id)["status"] == "running", timeout=30, message=f"job {job_id} to run")
    placed = {server.job(job_id)["worker_id"]: server.job(job_id)["gpu_indices"] for job_id in long}
    assert placed == {worker.id: [0] for worker in workers}, placed  # one on each agent, on its GPU 0

    gang = submit(stage, gang_barrier, "beside")
    job = job_in(server, gang, *TERMINAL, timeout=JOB_DEADLINE_S)
    assert (job["status"], job["attempt_count"], job["retry_count"]) == ("completed", 1, 0), job
    assert sorted((m["worker_id"], m["gpu_indices"], m["outcome"]) for m in job["members"]) == sorted(
        (worker.id, [1], "completed") for worker in workers
    )
    for agent in agents:  # each member ran exactly once
        assert len(agent.lines_matching(f"Job {gang} started")) == 1, agent.describe()
    seen = sorted(recorded(gang_barrier, "beside"), key=lambda entry: entry["rank"])
    assert [(e["rank"], e["heard"]) for e in seen] == [(0, [1]), (1, [0])], seen
    assert [e["cuda_visible_devices"] for e in seen] == ["1", "1"], seen  # each member saw its own free GPU
    assert [server.job(job_id)["status"] for job_id in long] == ["running", "running"]  # beside them all along

    (long_barrier / "hold").unlink()
    for job_id in long:
        assert job_in(server, job_id, *TERMINAL, timeout=JOB_DEADLINE_S)["status"] == "completed"
    for worker in workers:
        worker_when(server, worker.id, lambda w: (w["status"], w["gpus_free"], w["running_jobs"]) == ("idle", 2, []))
