"""One job's process on this node: its files, environment, process group, output and progress."""

import json
import os
import signal
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
