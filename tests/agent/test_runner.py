"""One job's process on this node: its files, environment, process group, output and progress."""

import json
import os
import signal
import socket
import sys
import textwrap
import threading
import time

import pytest

from worker_agent.runner import DEFAULT_COMMAND, STOP_AGENT_EXIT, STOP_CANCEL, JobRun, describe_exit, parse_command


def make_run(tmp_path, script, *, config=None, dataloader=None, grace=5.0):
    done = threading.Event()
    code = tmp_path / "trainer.py"
    code.write_text(textwrap.dedent(script))
    run = JobRun(
        job_id="j_1",
        attempt="a_1",
        config=config if config is not None else {"max_train_steps": 3},
        dataloader=dataloader,
        work_dir=tmp_path / "jobs",
        command=[sys.executable, str(code)],
        on_exit=lambda finished: done.set(),
        grace=grace,
    )
    return run, done


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_writes_config_and_dataloader_and_sets_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SIMPLETUNER_WORKER_TOKEN", "wt_must_not_leak")
    run, done = make_run(
        tmp_path,
        """
        import json, os
        keys = ["CONFIG_PATH", "SIMPLETUNER_CONFIG_BACKEND", "SIMPLETUNER_JOB_ID", "SIMPLETUNER_JOB_DIR", "SIMPLETUNER_WORKER_TOKEN"]
        print(json.dumps({k: os.environ.get(k) for k in keys} | {"cwd": os.getcwd()}))
        """,
        config={"--model_type": "lora", "--max_train_steps": 3},
        dataloader=[{"id": "pics", "type": "local"}],
    )
    run.start()
    assert done.wait(10)
    job_dir = tmp_path / "jobs" / "j_1"
    seen = json.loads(run.log_tail())
    assert seen["CONFIG_PATH"] == str(job_dir / "config.json")
    assert seen["SIMPLETUNER_CONFIG_BACKEND"] == "json"
    assert seen["SIMPLETUNER_JOB_ID"] == "j_1" and seen["SIMPLETUNER_JOB_DIR"] == str(job_dir)
    assert seen["SIMPLETUNER_WORKER_TOKEN"] is None
    assert seen["cwd"] == str(job_dir)
    written = json.loads((job_dir / "config.json").read_text())
    assert written["--model_type"] == "lora"
    assert written["--data_backend_config"] == str(job_dir / "multidatabackend.json")
    assert json.loads((job_dir / "multidatabackend.json").read_text()) == [{"id": "pics", "type": "local"}]
    assert run.returncode == 0


def test_progress_lines_fold_into_progress_and_stay_out_of_the_tail(tmp_path):
    run, done = make_run(
        tmp_path,
        """
        import sys
        print("loading model")
        print('SIMPLETUNER_PROGRESS {"step": 1, "total_steps": 4, "loss": 0.9}')
        print('SIMPLETUNER_PROGRESS {"step": 2, "loss": 0.5, "metrics": {"acc": 0.7}}')
        sys.stderr.write("a warning on stderr\\n")
        sys.stdout.write("epoch 1: 10%\\repoch 1: 50%\\repoch 1: 100%\\n")
        """,
    )
    run.start()
    assert done.wait(10)
    progress, version = run.snapshot()
    assert progress["step"] == 2 and progress["total_steps"] == 4 and progress["loss"] == 0.5
    assert progress["fraction"] == 0.5 and progress["metrics"] == {"acc": 0.7}
    tail = run.log_tail().splitlines()
    assert "loading model" in tail and "a warning on stderr" in tail and "epoch 1: 100%" in tail
    assert not any("SIMPLETUNER_PROGRESS" in line for line in tail)
    assert version >= 4
    assert "SIMPLETUNER_PROGRESS" in (tmp_path / "jobs" / "j_1" / "train.log").read_text()  # the log keeps everything


def test_exit_code_of_a_failing_trainer(tmp_path):
    run, done = make_run(tmp_path, "import sys\nprint('boom')\nsys.exit(3)\n")
    run.start()
    assert done.wait(10)
    assert run.returncode == 3 and run.last_line() == "boom"
    assert describe_exit(3) == "exited with code 3"
    assert describe_exit(-9) == "killed by SIGKILL"


def test_stop_terminates_the_whole_process_group(tmp_path):
    run, done = make_run(
        tmp_path,
        """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        print(f"child {child.pid}", flush=True)
        time.sleep(60)
        """,
    )
    run.start()
    wait_until(lambda: run.last_line().startswith("child "))
    child_pid = int(run.last_line().split()[1])
    run.stop(STOP_CANCEL)
    assert done.wait(10)
    assert run.stop_reason == STOP_CANCEL and run.returncode == -signal.SIGTERM
    wait_until(lambda: not _alive(child_pid))


def test_sigkill_after_the_grace_period(tmp_path):
    run, done = make_run(
        tmp_path,
        """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ignoring SIGTERM", flush=True)
        time.sleep(60)
        """,
        grace=0.5,
    )
    run.start()
    wait_until(lambda: run.last_line() == "ignoring SIGTERM")
    started = time.monotonic()
    run.stop(STOP_AGENT_EXIT)
    assert done.wait(10)
    assert run.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 5


def test_a_trainer_that_handles_sigterm_exits_its_own_way(tmp_path):
    run, done = make_run(
        tmp_path,
        """
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *a: (print("checkpoint saved", flush=True), sys.exit(143)))
        print("ready", flush=True)
        time.sleep(60)
        """,
    )
    run.start()
    wait_until(lambda: run.last_line() == "ready")
    run.stop(STOP_CANCEL)
    assert done.wait(10)
    assert run.returncode == 143 and run.last_line() == "checkpoint saved"


def test_missing_command_raises_at_start(tmp_path):
    run = JobRun(job_id="j", attempt=None, config={}, dataloader=None, work_dir=tmp_path, command=["/no/such/trainer"], on_exit=lambda r: None)
    with pytest.raises(OSError):
        run.start()


def test_parse_command():
    assert parse_command(None) == list(DEFAULT_COMMAND)
    assert DEFAULT_COMMAND[1:] == ("-m", "simpletuner.train")
    assert parse_command("python -m x --name 'a b'") == ["python", "-m", "x", "--name", "a b"]
    # a relative program path is taken from where the agent started, not from the job directory
    assert parse_command(".venv/bin/python -m t") == [os.path.abspath(".venv/bin/python"), "-m", "t"]
    assert parse_command("/usr/bin/python3 x")[0] == "/usr/bin/python3"
    with pytest.raises(ValueError):
        parse_command("   ")


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
    return True


def test_output_hands_out_its_unsent_lines_by_number_until_accepted():
    from worker_agent.runner import Output

    output = Output()
    for line in (b"first", b'SIMPLETUNER_PROGRESS {"step": 1}', b"second", b"   ", b"third"):
        output.add(line)
    chunk = output.log_chunk(max_lines=2)
    assert chunk == {"from": 0, "lines": ["first", "second"]}  # progress and blank lines are not counted
    output.log_sent(2)
    assert output.log_chunk() == {"from": 2, "lines": ["third"]}
    output.log_sent(3)
    assert output.log_chunk() is None
    output.add(b"fourth")
    assert output.log_chunk() == {"from": 3, "lines": ["fourth"]}


def test_output_lines_never_accepted_beyond_its_memory_are_skipped_by_number(monkeypatch):
    from collections import deque

    from worker_agent.runner import Output

    output = Output()
    output.unsent = deque(maxlen=3)
    for n in range(5):
        output.add(f"line {n}".encode())
    assert output.log_chunk() == {"from": 2, "lines": ["line 2", "line 3", "line 4"]}  # lines 0-1 were lost


# --- where a job runs: its GPUs, and for a multi-node job its rendezvous (issue 30) ---------------------

PRINT_PLACEMENT = """
import json, os
keys = ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES"]
print(json.dumps({k: os.environ.get(k) for k in keys}))
"""


def run_placed(tmp_path, job_id, config, placement, monkeypatch):
    for name in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES"):
        monkeypatch.delenv(name, raising=False)
    # One script per job: rewriting the one another trainer is starting from would hand it an empty file.
    code = tmp_path / f"trainer-{job_id}.py"
    code.write_text(textwrap.dedent(PRINT_PLACEMENT))
    done = threading.Event()
    run = JobRun(
        job_id=job_id, attempt="a_1", config=config, dataloader=None, work_dir=tmp_path / "jobs",
        command=[sys.executable, str(code)], on_exit=lambda finished: done.set(), placement=placement,
    )  # fmt: skip
    run.start()
    return run, done


def test_each_of_four_jobs_sees_its_own_gpus_in_its_environment_and_config(tmp_path, monkeypatch):
    runs = [
        run_placed(tmp_path, f"j_{index}", {"max_train_steps": 3, "num_processes": 8}, {"gpu_indices": [index]}, monkeypatch)
        for index in range(4)
    ]
    for index, (run, done) in enumerate(runs):
        assert done.wait(10) and run.returncode == 0
        seen = json.loads(run.log_tail())
        assert seen == {"CUDA_VISIBLE_DEVICES": str(index), "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "MASTER_ADDR": None,
                        "MASTER_PORT": None, "NODE_RANK": None, "NNODES": None}  # fmt: skip
        written = json.loads((run.job_dir / "config.json").read_text())
        assert written["accelerate_visible_devices"] == str(index) and written["num_processes"] == 1
        assert "num_machines" not in written and "same_network" not in written


def test_a_multi_node_member_gets_the_rendezvous_in_env_and_config_in_the_configs_key_style(tmp_path, monkeypatch):
    placement = {"gpu_indices": [2, 3], "num_nodes": 2, "node_rank": 1, "master_addr": "10.0.0.5", "master_port": 29511}
    run, done = run_placed(tmp_path, "j_gang", {"--model_type": "lora", "--num_processes": 1}, placement, monkeypatch)
    assert done.wait(10) and run.returncode == 0
    assert json.loads(run.log_tail()) == {
        "CUDA_VISIBLE_DEVICES": "2,3", "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29511", "NODE_RANK": "1", "NNODES": "2",
    }  # fmt: skip
    written = json.loads((run.job_dir / "config.json").read_text())
    assert {k: v for k, v in written.items() if k not in ("--output_dir", "--webhook_config")} == {
        "--model_type": "lora",
        "--num_processes": 4,  # 2 GPUs here x 2 nodes
        "--accelerate_visible_devices": "2,3",
        "--num_machines": 2,
        "--machine_rank": 1,
        "--main_process_ip": "10.0.0.5",
        "--main_process_port": 29511,
        "--same_network": True,
    }


def test_a_whole_worker_restricted_by_gpus_is_in_the_environment_only(tmp_path, monkeypatch):
    from worker_agent.runner import WORKER_GPUS

    run, done = run_placed(tmp_path, "j_whole", {"num_processes": 2}, {WORKER_GPUS: [2, 3]}, monkeypatch)
    assert done.wait(10) and run.returncode == 0
    seen = json.loads(run.log_tail())
    assert (seen["CUDA_VISIBLE_DEVICES"], seen["CUDA_DEVICE_ORDER"], seen["NNODES"]) == ("2,3", "PCI_BUS_ID", None)
    written = json.loads((run.job_dir / "config.json").read_text())
    assert set(written) == {"num_processes", "output_dir", "webhook_config"} and written["num_processes"] == 2


def test_without_a_placement_config_and_environment_are_as_before(tmp_path, monkeypatch):
    run, done = run_placed(tmp_path, "j_plain", {"num_processes": 2}, None, monkeypatch)
    assert done.wait(10) and run.returncode == 0
    assert set(json.loads(run.log_tail()).values()) == {None}
    written = json.loads((run.job_dir / "config.json").read_text())
    assert written["num_processes"] == 2 and "accelerate_visible_devices" not in written
    assert set(written) == {"num_processes", "output_dir", "webhook_config"}


RENDEZVOUS = """
import os, socket, sys, time
rank, addr, port = int(os.environ["NODE_RANK"]), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
if rank == 0:
    server = socket.create_server((addr, port))
    server.settimeout(10)
    peer, _ = server.accept()
else:
    deadline = time.monotonic() + 10
    while True:
        try:
            peer = socket.create_connection((addr, port), timeout=1)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
peer.sendall(str(rank).encode())
print(f"rank {rank} of {os.environ['NNODES']} met rank {peer.recv(16).decode()}")
"""


def test_two_members_meet_at_the_rendezvous_their_environment_names(tmp_path, monkeypatch):
    with socket.socket() as probe:  # a free port (the orchestrator assigns one; nothing holds it when trainers start)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = tmp_path / "rendezvous.py"
    code.write_text(textwrap.dedent(RENDEZVOUS))
    members = []
    for rank in (1, 0):  # the member that connects may start first
        done = threading.Event()
        placement = {"gpu_indices": [rank], "num_nodes": 2, "node_rank": rank, "master_addr": "127.0.0.1", "master_port": port}
        run = JobRun(
            job_id=f"j_rank{rank}", attempt="a_1", config={}, dataloader=None, work_dir=tmp_path / f"node{rank}",
            command=[sys.executable, str(code)], on_exit=lambda finished, done=done: done.set(), placement=placement,
        )  # fmt: skip
        members.append((rank, run.start(), done))
    for rank, run, done in members:
        assert done.wait(20) and run.returncode == 0, run.log_tail()
        assert run.log_tail() == f"rank {rank} of 2 met rank {1 - rank}"
