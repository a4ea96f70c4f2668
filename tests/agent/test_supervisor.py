"""The trainer's supervisor records how every trainer ended, and a restarted agent reports what it finds.

Real processes: a trainer under its supervisor, and an "agent" process killed -9 around them.
"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from worker_agent import journal, protocol, supervisor
from worker_agent.runner import (
    STOP_ABANDON,
    STOP_AGENT_DIED,
    STOP_AGENT_EXIT,
    STOP_CANCEL,
    STOP_FILE,
    JobRun,
    exit_report,
    read_log,
)

from .test_runner import make_run, wait_until


def test_the_record_says_how_the_trainer_ended_and_the_supervisor_exits_as_it_did(tmp_path):
    run, done = make_run(tmp_path, "import sys\nprint('boom')\nsys.exit(3)\n")
    run.start()
    assert done.wait(10)
    assert run.returncode == 3
    record = supervisor.exit_record(run.job_dir)
    assert (record["job_id"], record["attempt"], record["returncode"], record["stopped_by_supervisor"]) == ("j_1", "a_1", 3, False)


def test_a_trainer_killed_by_a_signal_is_recorded_as_such(tmp_path):
    run, done = make_run(tmp_path, "import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    run.start()
    wait_until(lambda: run.last_line() == "ready")
    run.stop(STOP_CANCEL)
    assert done.wait(10)
    assert run.returncode == -signal.SIGTERM
    assert supervisor.exit_record(run.job_dir)["returncode"] == -signal.SIGTERM
    assert json.loads((run.job_dir / STOP_FILE).read_text()) == {"attempt": "a_1", "reason": STOP_CANCEL}


def test_a_command_that_cannot_run_is_refused_before_anything_starts(tmp_path):
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\n")
    for command, error in (([str(tmp_path / "missing")], FileNotFoundError), ([str(script)], PermissionError), (["no-such-program-x"], FileNotFoundError)):
        run = JobRun(job_id="j", attempt=None, config={}, dataloader=None, work_dir=tmp_path / "jobs", command=command, on_exit=lambda r: None)
        with pytest.raises(error):
            run.start()
    assert not (tmp_path / "jobs").exists()


AGENT = """
import sys, threading, time
from worker_agent.runner import JobRun
run = JobRun(job_id="j_1", attempt="a_1", config={}, dataloader=None, work_dir=sys.argv[1],
             command=[sys.executable, sys.argv[2]], on_exit=lambda r: None, grace=float(sys.argv[3]))
run.start()
print(run.process.pid, flush=True)
time.sleep(120)
"""


def agent_with_a_trainer(tmp_path, trainer, *, grace=5.0):
    """Start an agent-like process running ``trainer`` under its supervisor; return (agent, supervisor pid)."""
    code = tmp_path / "trainer.py"
    code.write_text(textwrap.dedent(trainer))
    agent = subprocess.Popen(
        [sys.executable, "-c", AGENT, str(tmp_path / "jobs"), str(code), str(grace)],
        stdout=subprocess.PIPE,
        cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    return agent, int(agent.stdout.readline())


def wait_for_exit(pid, timeout=15):
    wait_until(lambda: not _alive(pid), timeout=timeout)


def kill_agent_mid_run(tmp_path, agent, supervisor_pid):
    """Once the trainer has printed "ready", kill -9 the agent; return the supervisor's exit record."""
    log = tmp_path / "jobs" / "j_1" / "train.log"
    wait_until(lambda: log.exists() and "ready" in log.read_text())
    agent.kill()
    agent.wait()
    wait_for_exit(supervisor_pid)
    return supervisor.exit_record(tmp_path / "jobs" / "j_1")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone between the open and the read
        return False


def test_when_the_agent_dies_the_supervisor_stops_the_trainer_and_records_that_it_did(tmp_path):
    agent, supervisor_pid = agent_with_a_trainer(tmp_path, "import time\nprint('ready', flush=True)\ntime.sleep(60)\n")
    record = kill_agent_mid_run(tmp_path, agent, supervisor_pid)
    assert (record["returncode"], record["stopped_by_supervisor"]) == (-signal.SIGTERM, True)
    assert "supervisor: the agent is gone; stopping the trainer" in (tmp_path / "jobs" / "j_1" / "train.log").read_text()
    # A restarted agent: no result to report (the orchestrator requeues the job), the record settled.
    assert journal.recover_exits(tmp_path / "jobs") == []
    assert journal.undelivered(tmp_path / "jobs") == []
    assert (tmp_path / "jobs" / "j_1" / supervisor.SETTLED_FILE).is_file()


def test_a_trainer_that_ignores_sigterm_after_its_agent_died_is_killed_after_the_grace_period(tmp_path):
    trainer = """
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print('ready', flush=True)
    time.sleep(60)
    """
    agent, supervisor_pid = agent_with_a_trainer(tmp_path, trainer, grace=0.5)
    record = kill_agent_mid_run(tmp_path, agent, supervisor_pid)
    assert (record["returncode"], record["stopped_by_supervisor"]) == (-signal.SIGKILL, True)


def test_a_supervisor_whose_agent_is_gone_before_its_handler_is_in_place_starts_no_trainer(tmp_path):
    """The agent died while this supervisor was starting, and the parent-death signal was lost: its parent is no
    longer the agent named by --agent-pid. No trainer starts; the record says the supervisor stopped it."""
    marker = tmp_path / "trainer-ran"
    trainer = [sys.executable, "-c", f"open({str(marker)!r}, 'w').close()"]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that is not this supervisor's parent
    env = {**os.environ, "SIMPLETUNER_JOB_ID": "j_1", "SIMPLETUNER_ATTEMPT": "a_1"}
    done = subprocess.run(
        [sys.executable, "-I", supervisor.__file__, "--grace", "1", "--agent-pid", str(gone.pid), "--", *trainer],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30,
    )
    assert done.returncode == -signal.SIGTERM, done.stderr
    assert "the agent is gone before the trainer started" in done.stderr
    assert not marker.exists()
    record = supervisor.exit_record(tmp_path)
    assert (record["returncode"], record["stopped_by_supervisor"], record["attempt"]) == (-signal.SIGTERM, True, "a_1")


AGENT_IGNORING_SIGHUP = """
import os, signal, sys, time
from worker_agent.runner import JobRun
signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as under nohup: the supervisor inherits it
run = JobRun(job_id="j_1", attempt="a_1", config={}, dataloader=None, work_dir=sys.argv[1],
             command=[sys.executable, sys.argv[2]], on_exit=lambda r: None, grace=5.0)
run.start()
os._exit(0)  # gone before the supervisor (still starting Python) has its handler in place
"""


def test_an_agent_with_sighup_ignored_that_dies_as_its_supervisor_starts_leaves_no_trainer_running(tmp_path):
    """Seen end to end (a gang member's trainer that outlived its agent's kill -9 and ran on): the agent ignored
    SIGHUP (nohup), so its death while the supervisor was starting sent a signal nobody heard."""
    marker = tmp_path / "trainer-ran"
    trainer = tmp_path / "trainer.py"
    trainer.write_text(f"import time\ntime.sleep(0.5)\nopen({str(marker)!r}, 'w').close()\n")
    agent = subprocess.run(
        [sys.executable, "-c", AGENT_IGNORING_SIGHUP, str(tmp_path / "jobs"), str(trainer)],
        cwd=os.getcwd(), env={**os.environ, "PYTHONPATH": os.getcwd()}, timeout=30,
    )
    assert agent.returncode == 0
    job_dir = tmp_path / "jobs" / "j_1"
    # The record is written once the trainer has ended: had one started, its marker is there by then.
    wait_until(lambda: supervisor.exit_record(job_dir) is not None, timeout=15)
    assert not marker.exists()
    record = supervisor.exit_record(job_dir)
    assert (record["returncode"], record["stopped_by_supervisor"]) == (-signal.SIGTERM, True)
    # A restarted agent: nothing to report (the orchestrator requeues the job), the record settled.
    assert journal.recover_exits(tmp_path / "jobs") == []


def test_a_trainer_that_completed_before_its_agent_died_is_recorded_as_completed(tmp_path):
    trainer = """
    import os, signal, time
    print('SIMPLETUNER_PROGRESS {"step": 5, "total_steps": 5}', flush=True)
    print('all done', flush=True)
    """
    agent, supervisor_pid = agent_with_a_trainer(tmp_path, trainer)
    wait_for_exit(supervisor_pid)
    agent.kill()
    agent.wait()
    record = supervisor.exit_record(tmp_path / "jobs" / "j_1")
    assert (record["returncode"], record["stopped_by_supervisor"]) == (0, False)
    assert journal.recover_exits(tmp_path / "jobs") == ["j_1"]
    ((path, job_id, report),) = journal.undelivered(tmp_path / "jobs")
    assert (job_id, report["status"], report["attempt"], report["exit_code"]) == ("j_1", protocol.COMPLETED, "a_1", 0)
    assert report["progress"]["step"] == 5 and report["log_tail"] == "all done"


def write_exit(job_dir, code, *, attempt="a_1", stopped=False, log="", stop=None):
    job_dir.mkdir(parents=True, exist_ok=True)
    record = {"version": 1, "job_id": job_dir.name, "attempt": attempt, "returncode": code, "stopped_by_supervisor": stopped}
    (job_dir / supervisor.EXIT_FILE).write_text(json.dumps(record))
    (job_dir / "train.log").write_text(log)
    if stop:
        (job_dir / STOP_FILE).write_text(json.dumps({"attempt": attempt, "reason": stop}))


def test_recover_exits_applies_the_agents_own_rule_to_each_unsettled_record(tmp_path):
    write_exit(tmp_path / "j_ok", 0, log='loading\nSIMPLETUNER_PROGRESS {"step": 3, "total_steps": 3}\ndone\n')
    write_exit(tmp_path / "j_failed", 3, log="loading\nCUDA out of memory\n")
    write_exit(tmp_path / "j_cancelled", -15, stop=STOP_CANCEL)
    write_exit(tmp_path / "j_abandoned", -15, stop=STOP_ABANDON)
    write_exit(tmp_path / "j_died", -15, stopped=True)
    write_exit(tmp_path / "j_done_first", 0, stopped=True)  # completed as the SIGTERM came: a result
    write_exit(tmp_path / "j_stale_stop", 3, stop=STOP_ABANDON)
    (tmp_path / "j_stale_stop" / STOP_FILE).write_text(json.dumps({"attempt": "a_0", "reason": STOP_ABANDON}))
    recovered = journal.recover_exits(tmp_path)
    assert sorted(recovered) == ["j_cancelled", "j_done_first", "j_failed", "j_ok", "j_stale_stop"]
    reports = {job_id: report for _, job_id, report in journal.undelivered(tmp_path)}
    assert reports["j_ok"] == {
        "attempt": "a_1",
        "exit_code": 0,
        "progress": reports["j_ok"]["progress"],
        "log_tail": "loading\ndone",
        "status": protocol.COMPLETED,
        "error": None,
    }
    assert reports["j_ok"]["progress"]["step"] == 3
    assert (reports["j_failed"]["status"], reports["j_failed"]["error"]) == (protocol.FAILED, "Training exited with code 3: CUDA out of memory")
    assert (reports["j_cancelled"]["status"], reports["j_cancelled"]["exit_code"]) == (protocol.CANCELLED, 143)
    assert reports["j_done_first"]["status"] == protocol.COMPLETED
    assert reports["j_stale_stop"]["status"] == protocol.FAILED  # the stop was another attempt's
    for name in ("j_ok", "j_failed", "j_cancelled", "j_abandoned", "j_died", "j_done_first", "j_stale_stop"):
        assert not (tmp_path / name / supervisor.EXIT_FILE).exists() and (tmp_path / name / supervisor.SETTLED_FILE).exists()
    assert journal.recover_exits(tmp_path) == []  # settled: never twice


def test_recover_exits_settles_a_record_whose_attempt_is_journaled_and_leaves_an_unreadable_one(tmp_path):
    journal.write_outcome(tmp_path / "j_1", "j_1", {"status": "failed", "attempt": "a_1", "error": "as the agent saw it"})
    write_exit(tmp_path / "j_1", 0)
    (tmp_path / "j_bad").mkdir()
    (tmp_path / "j_bad" / supervisor.EXIT_FILE).write_text('{"returncode": ')
    assert journal.recover_exits(tmp_path) == []
    ((_, _, report),) = journal.undelivered(tmp_path)
    assert report["error"] == "as the agent saw it"  # the agent's own outcome stands
    assert (tmp_path / "j_1" / supervisor.SETTLED_FILE).exists()
    assert (tmp_path / "j_bad" / supervisor.EXIT_FILE).exists()


@pytest.mark.parametrize(
    ("code", "stop", "status"),
    [
        (0, None, protocol.COMPLETED),
        (0, STOP_AGENT_EXIT, protocol.COMPLETED),
        (0, STOP_AGENT_DIED, protocol.COMPLETED),
        (2, None, protocol.FAILED),
        (-9, None, protocol.FAILED),
        (-15, STOP_AGENT_EXIT, None),
        (-15, STOP_AGENT_DIED, None),
        (0, STOP_ABANDON, None),
        (-15, STOP_ABANDON, None),
        (0, STOP_CANCEL, protocol.CANCELLED),
        (-15, STOP_CANCEL, protocol.CANCELLED),
    ],
)
def test_exit_report_is_one_rule_for_every_end(code, stop, status):
    report = exit_report("a_1", code, stop, progress={}, log_tail="x", last_line="x")
    assert (report and report["status"]) == (status and status)
    if report:
        assert report["exit_code"] == (128 - code if code < 0 else code) and report["attempt"] == "a_1"


def test_read_log_folds_what_the_trainer_wrote_and_tolerates_any_bytes(tmp_path):
    (tmp_path / "train.log").write_bytes(b"bad \xff\xfe bytes\r\nnul \x00 byte\nSIMPLETUNER_PROGRESS {\"step\": 2}\nlast")
    output = read_log(tmp_path)
    assert output.progress["step"] == 2
    assert output.log_tail().splitlines() == ["bad \ufffd\ufffd bytes", "nul  byte", "last"]  # control characters go
    assert read_log(tmp_path / "missing").log_tail() == ""


def test_the_agent_follows_output_written_to_its_log(tmp_path):
    """The trainer writes to train.log itself; the agent's view (tail, progress) follows it."""
    trainer = """
    import time
    for step in range(1, 4):
        print(f'SIMPLETUNER_PROGRESS {{"step": {step}, "total_steps": 3}}', flush=True)
        print(f'line {step}', flush=True)
        time.sleep(0.2)
    """
    run, done = make_run(tmp_path, trainer)
    seen = []
    run.start()
    watcher = threading.Thread(target=lambda: [seen.append(run.snapshot()[0].get("step")) for _ in iter(lambda: done.wait(0.05), True)])
    watcher.start()
    assert done.wait(10)
    watcher.join()
    assert run.snapshot()[0]["step"] == 3 and run.log_tail() == "line 1\nline 2\nline 3"
    assert any(step in (1, 2) for step in seen)  # seen while it ran, not only at the end
