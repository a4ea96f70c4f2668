"""The proof with SimpleTuner's own trainer (``make interop``; docs/testing.md): a real orchestrator
(``simpletuner server``, its sweeps on), real agents and ``python -m simpletuner.train`` training
make_tiny.py's tiny SDXL LoRA on CPU, its config stored and submitted by name.

1. One job, uninterrupted: its progress (step, total and loss) shows in the API while it runs, each
   checkpoint is uploaded as the trainer finishes it and recorded complete, and the job completes.
2. The same config again; its node (agent and trainer process group) is killed with kill -9 once the
   orchestrator holds ``checkpoint-4`` complete and before ``checkpoint-6`` exists (the trainer pauses
   after checkpoint-4's marker: the test's window). The job resumes on another agent from step 4,
   completes, and its final weights have the SHA-256 of job 1's.
3. The same again, killed once ``checkpoint-6`` (the final step) is complete: the next attempt runs no
   trainer and completes with that checkpoint's weights.

Runs only under ``make interop`` (SIMPLETUNER_INTEROP=1), on SQLite and on PostgreSQL + Redis; without
SimpleTuner's venv it is skipped with the reason (failed under CI=true).
"""

import hashlib
import json
import os
import struct
import time

import pytest

from tests.services import missing_service

from . import interop
from .agent_harness import AgentProcess, job_in, job_when, trainer_processes
from .harness import REPO_ROOT, poll
from .interop import BACKENDS, completed_steps, job_dir_of, kill_node, run_agents, serve

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(1200),  # minutes of training on a loaded CPU, not the suite's 300 s
    pytest.mark.skipif(os.environ.get("SIMPLETUNER_INTEROP") != "1", reason="minutes of real training: run by `make interop`"),
]

STEPS, EVERY = 6, 2  # make_tiny.py's defaults: checkpoint-2, -4 and -6
FINAL = "output/pytorch_lora_weights.safetensors"
TIMERS = {  # a lost node is noticed within seconds; a trainer's CPU load must not make a live agent look lost
    "SIMPLETUNER_HEARTBEAT_TIMEOUT": "10",
    "SIMPLETUNER_HEALTH_CHECK_INTERVAL": "1",
    "SIMPLETUNER_DISPATCH_ACK_TIMEOUT": "30",
}
RUN_DEADLINE_S = 300
RESULTS_DIR = REPO_ROOT / "test-artifacts" / "interop"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    reason = interop.missing()
    if reason:
        missing_service(reason)
    started = time.monotonic()
    job = interop.TinyJob(tmp_path_factory.mktemp("tiny")).build()
    job.build_seconds = time.monotonic() - started
    return job


@pytest.fixture(params=BACKENDS)
def server(request, tmp_path):
    yield from serve(request, tmp_path, TIMERS)


@pytest.fixture(params=BACKENDS)
def default_server(request, tmp_path):
    """With the default timers: SimpleTuner's released agent heartbeats every 30 s, and not while it waits
    for its trainer's next line."""
    yield from serve(request, tmp_path, {})


@pytest.fixture
def runner(server, tmp_path):
    yield from run_agents(server, tmp_path, "interop")


# --- what the test looks at --------------------------------------------------------------------------


def artifacts_of(job):
    return {a["key"]: a for a in job["artifacts"]}


def tensors_sha256(data):
    """SHA-256 of a safetensors file's tensors alone (a checkpoint's copy carries run-varying metadata)."""
    size = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode() + data[8 + size :]).hexdigest()


def download(server, artifact):
    url = artifact["download_url"]
    response = server.admin("GET", url.removeprefix(server.base_url))  # an absolute URL or a path
    assert response.status_code == 200, response.text[:300]
    assert hashlib.sha256(response.content).hexdigest() == artifact["sha256"]
    return response.content


def start_agent(runner, tiny, labels, **env):
    agent = runner.start(runner.fleet.create_worker(labels=labels), extra_args=("--command", tiny.command()), env=env)
    runner.wait_ready(agent)
    return agent


def submit(runner, name, labels):
    """Submit the stored config ``name`` for workers matching ``labels``; return the job's id."""
    return runner.submit(labels=labels, config={}, config_name=name)["job_id"]


# --- the proof -----------------------------------------------------------------------------------------


def test_simpletuner_trains_resumes_after_its_node_is_killed_and_gives_the_same_weights(server, runner, tiny):
    tag = runner.fleet.tag
    name = f"tiny-sdxl-{tag}"
    stored = server.admin("POST", "/api/configs", json={"name": name, "config": tiny.config, "dataloader": tiny.dataloader})
    assert stored.status_code == 201, stored.text
    figures = {"backend": server.backend, "build_s": round(tiny.build_seconds, 1)}

    # 1. One job, uninterrupted.
    first_agent = start_agent(runner, tiny, {"pool": f"a-{tag}"})
    started = time.monotonic()
    job_1 = submit(runner, name, {"pool": f"a-{tag}"})
    seen, uploaded_while_running = [], set()

    def watched(job):
        if job["status"] == "running":
            if job["progress"]:
                seen.append(job["progress"])
            uploaded_while_running.update(k for k in artifacts_of(job) if k.endswith("/.guard"))
        return job["status"] in ("completed", "failed", "cancelled")

    job = job_when(server, job_1, watched, timeout=RUN_DEADLINE_S, message="job 1 to end")
    figures["job_1_s"] = round(time.monotonic() - started, 1)
    assert job["status"] == "completed", job
    mid_run = [p for p in seen if isinstance(p.get("step"), int) and 0 < p["step"] < STEPS]
    assert mid_run, f"no progress with a step short of {STEPS} was seen while it ran: {seen[-5:]}"
    assert all(p.get("total_steps") == STEPS for p in mid_run), mid_run
    assert any(isinstance(p.get("loss"), (int, float)) for p in mid_run), mid_run
    artifacts_1 = artifacts_of(job)
    for step in range(EVERY, STEPS + 1, EVERY):
        assert {f"output/checkpoint-{step}/.guard", f"output/checkpoint-{step}/pytorch_lora_weights.safetensors"} <= set(artifacts_1)
    assert "output/checkpoint-2/.guard" in uploaded_while_running  # it left the node before the trainer ended
    lease_1 = job["attempts"][0]["lease_id"]
    assert completed_steps(server, job_1) == {(lease_1, 2), (lease_1, 4), (lease_1, 6)}
    final_1 = download(server, artifacts_1[FINAL])
    first_agent.terminate()
    first_agent.wait_exit(timeout=30)

    # 2. The same config; the node killed between checkpoint-4 (held complete) and checkpoint-6.
    pool = {"pool": f"b-{tag}"}
    doomed = start_agent(runner, tiny, pool, **{interop.PAUSE_ENV: "checkpoint-4:120"})
    started = time.monotonic()
    job_2 = submit(runner, name, pool)
    job_dir = job_dir_of(doomed, job_2)
    poll(lambda: any(step == 4 for _, step in completed_steps(server, job_2)), timeout=RUN_DEADLINE_S,
         interval=0.2, message="checkpoint-4 held complete")  # fmt: skip
    output = next(job_dir.rglob("checkpoint-4")).parent
    assert not (output / "checkpoint-6").exists()
    kill_node(doomed, job_dir)
    killed_at = time.monotonic()
    assert not (output / "checkpoint-6").exists()
    figures["killed_after_s"] = round(killed_at - started, 1)

    rescuer = start_agent(runner, tiny, pool)
    job = job_in(server, job_2, "completed", "failed", "cancelled", timeout=RUN_DEADLINE_S)
    figures["resumed_run_s"] = round(time.monotonic() - killed_at, 1)
    figures["job_2_s"] = round(time.monotonic() - started, 1)
    assert job["status"] == "completed", job
    lost, resumed = job["attempts"]
    assert lost["outcome"] == "lost" and resumed["worker_id"] == rescuer.worker.id
    assert resumed["start_step"] == 4 and resumed["reached_step"] == STEPS, resumed
    rescued = {p.name for p in job_dir_of(rescuer, job_2).rglob("checkpoint-*") if p.is_dir()}
    assert rescued == {"checkpoint-4", "checkpoint-6"}, rescued  # downloaded 4, trained 5 and 6: no checkpoint-2 again
    artifacts_2 = artifacts_of(job)
    assert artifacts_2["output/checkpoint-6/.guard"]["attempt"] == 2
    final_2 = download(server, artifacts_2[FINAL])
    assert hashlib.sha256(final_2).hexdigest() == hashlib.sha256(final_1).hexdigest() == artifacts_1[FINAL]["sha256"]

    # 3. Killed once the final step's checkpoint is complete: not trained again.
    rescuer.terminate()
    rescuer.wait_exit(timeout=30)
    doomed = start_agent(runner, tiny, pool, **{interop.PAUSE_ENV: f"checkpoint-{STEPS}:120"})
    started = time.monotonic()
    job_3 = submit(runner, name, pool)
    job_dir = job_dir_of(doomed, job_3)
    poll(lambda: any(step == STEPS for _, step in completed_steps(server, job_3)), timeout=RUN_DEADLINE_S,
         interval=0.2, message=f"checkpoint-{STEPS} held complete")  # fmt: skip
    kill_node(doomed, job_dir)
    killed_at = time.monotonic()
    last = start_agent(runner, tiny, pool)
    job = job_in(server, job_3, "completed", "failed", "cancelled", timeout=120)
    figures["final_step_recovery_s"] = round(time.monotonic() - killed_at, 1)
    assert job["status"] == "completed", job
    assert [a["start_step"] for a in job["attempts"]] == [0, STEPS]
    assert f"checkpoint-{STEPS} is this run's final step (max_train_steps): not trained again" in last.output()
    assert job["attempts"][1]["reached_step"] == STEPS
    artifacts_3 = artifacts_of(job)
    final_3 = download(server, artifacts_3[FINAL])
    assert artifacts_3[FINAL]["attempt"] == 2
    assert final_3 == download(server, artifacts_3[f"output/checkpoint-{STEPS}/pytorch_lora_weights.safetensors"])
    assert tensors_sha256(final_3) == tensors_sha256(final_1)  # the same weights; the checkpoint's copy has its metadata

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / f"{server.backend}.json").write_text(json.dumps(figures, indent=1))
    print(f"\ninterop figures: {json.dumps(figures)}")


def test_simpletuners_released_agent_runs_the_same_job_and_keeps_its_checkpoints_on_its_node(default_server, tmp_path, tiny):
    """SimpleTuner's own agent (``python -m simpletuner.worker_agent`` from its venv) with the same stored job:
    it completes, its progress shows nothing (it reports none), and it uploads nothing: its checkpoints stay
    in the config's ``output_dir`` on its node. It registers without ``max_jobs``, so a second job submitted
    beside the first waits for it (one job at a time, whatever several jobs per worker allow ours)."""
    server = default_server
    agents = run_agents(server, tmp_path, "interop")
    runner = next(agents)
    try:
        tag = runner.fleet.tag
        output_dir = tmp_path / "upstream-output"  # the node's: its agent runs the config as it is
        config = {**tiny.config, "--output_dir": str(output_dir)}
        name = f"tiny-sdxl-upstream-{tag}"
        stored = server.admin("POST", "/api/configs", json={"name": name, "config": config, "dataloader": tiny.dataloader})
        assert stored.status_code == 201, stored.text
        worker = runner.fleet.create_worker(labels={"pool": f"u-{tag}"})
        home = tmp_path / "agents" / "upstream"
        home.mkdir(parents=True)
        agent = AgentProcess(
            label="upstream",
            argv=[str(interop.PEER_PYTHON), "-m", "simpletuner.worker_agent", "--orchestrator-url", server.base_url,
                  "--worker-token", worker.token, "--name", worker.name, "--persistent"],
            env=runner.env(**tiny.trainer_environment()), cwd=home, log_path=home / "agent.log", worker=worker,
        )  # fmt: skip
        runner.agents.append(agent)  # killed, and its log shown, at the end
        poll(lambda: worker.state()["stream_connected"], timeout=60, message="SimpleTuner's agent to connect")
        second_config = {**config, "--output_dir": str(tmp_path / "upstream-second")}
        second_name = f"{name}-second"
        stored = server.admin("POST", "/api/configs", json={"name": second_name, "config": second_config, "dataloader": tiny.dataloader})
        assert stored.status_code == 201, stored.text
        started = time.monotonic()
        job_id = submit(runner, name, {"pool": f"u-{tag}"})
        second_id = submit(runner, second_name, {"pool": f"u-{tag}"})
        job_in(server, job_id, "running", timeout=60)
        assert server.job(second_id)["status"] == "queued"  # its one worker runs the first
        assert [held["job_id"] for held in worker.state()["running_jobs"]] == [job_id]
        job = job_in(server, job_id, "completed", "failed", "cancelled", timeout=RUN_DEADLINE_S)
        took = round(time.monotonic() - started, 1)
        assert job["status"] == "completed", f"{job}\n{agent.describe()}"
        second = job_in(server, second_id, "completed", "failed", "cancelled", timeout=RUN_DEADLINE_S)
        assert second["status"] == "completed", f"{second}\n{agent.describe()}"
        assert second["dispatched_at"] >= job["finished_at"]
        assert job["artifacts"] == []
        kept = sorted(p.name for p in output_dir.glob("checkpoint-*"))
        assert kept == ["checkpoint-2", "checkpoint-4", "checkpoint-6"] and (output_dir / "pytorch_lora_weights.safetensors").exists()
        assert all((output_dir / k / ".guard").read_text().strip() == "complete" for k in kept)
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        (RESULTS_DIR / f"{server.backend}-released-agent.json").write_text(json.dumps({"backend": server.backend, "job_s": took}))
        print(f"\ninterop figures (SimpleTuner's released agent): {server.backend} job {took} s")
    finally:
        for process in trainer_processes(tmp_path / "agents" / "upstream", supervisors=True):
            process.kill()  # its trainer is its child, in its working directory, not in a group of its own
        next(agents, None)
