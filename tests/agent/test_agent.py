"""The agent's decisions, driven message by message with a fake orchestrator, clock, monitor and job."""

import json
import logging
import signal
from pathlib import Path

import pytest

from worker_agent import protocol
from worker_agent.agent import Agent
from worker_agent.cli import AgentConfig
from worker_agent.client import FatalError, TransientError
from worker_agent.runner import STOP_ABANDON, STOP_AGENT_EXIT, STOP_CANCEL
from worker_agent.session import EPHEMERAL_GIVE_UP_S
from worker_agent.sse import Event

from .fakes import FakeClient, FakeMonitor, FakeRun, refused


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


class FakeStream:
    def __init__(self):
        self.opened = 0
        self.stopped = False

    def start(self):
        return self

    def go(self):
        self.opened += 1

    def stop(self):
        self.stopped = True


def make_agent(*, persistent=True, command="python train.py"):
    config = AgentConfig(
        orchestrator_url="http://orch:8001",
        token="wt_x",
        name="gpu-1",
        persistent=persistent,
        verify=True,
        work_dir=Path("/tmp/agent-jobs"),
        command=command,
        heartbeat_interval=None,
        cancel_grace=30.0,
    )
    FakeRun.instances.clear()
    agent = Agent(
        config, client=FakeClient(), monitor=FakeMonitor(), clock=Clock(), run_factory=FakeRun, stream=FakeStream()
    )
    agent._start_up()
    return agent


def registered(**kwargs):
    agent = make_agent(**kwargs)
    agent.tick()
    assert agent.registered
    return agent


def pump(agent):
    """Handle every message the fake job posted (its exit), as the main loop would."""
    while not agent.inbox.empty():
        agent.handle(agent.inbox.get_nowait())


def submit(agent, job_id="j_1", attempt="a_1", **extra):
    payload = {"type": "job_submit", "job_id": job_id, "attempt": attempt, "config": {"x": 1}, "dataloader": None,
               "upload_endpoint": f"/api/workers/job/{job_id}/status", **extra}
    agent.on_event(Event("job_submit", json.dumps(payload), "worker-w_1:1"))
    return FakeRun.instances[-1] if FakeRun.instances else None


# --- registration -----------------------------------------------------------------------------


def test_registers_with_capabilities_then_opens_the_stream_and_schedules_heartbeats():
    agent = registered()
    name, body = agent.client.calls[0]
    assert name == "register"
    assert body["name"] == "gpu-1" and body["persistent"] is True and body["current_job_id"] is None
    assert body["gpu_count"] == 2 and body["accelerator_type"] == "cuda"
    assert agent.stream.opened == 1
    assert agent.next_heartbeat == agent.clock.now + 30


def test_heartbeat_carries_status_and_metrics():
    agent = registered()
    agent.clock.now += 30
    agent.tick()
    body = agent.client.calls[-1][1]
    assert body["status"] == "idle" and body["current_job_id"] is None
    assert body["cpu_percent"] == 12.5 and body["gpu_utilization"] == [90, 80]


def test_heartbeat_takes_only_the_protocols_metric_fields_from_the_monitor():
    agent = registered()
    run = submit(agent)
    run.emit(step=3)
    agent.monitor.sample = lambda: {"cpu_percent": 5.0, "status": "idle", "current_job_id": None, "progress": 0, "fan": 1}
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    body = [c for c in agent.client.calls if c[0] == "heartbeat"][-1][1]
    assert body == {"status": "busy", "current_job_id": "j_1", "progress": {"step": 3}, "cpu_percent": 5.0}


def test_env_heartbeat_interval_wins_over_the_orchestrators():
    agent = make_agent()
    agent.config.heartbeat_interval = 5.0
    agent.heartbeat_interval = 5.0
    agent.tick()
    assert agent.next_heartbeat == agent.clock.now + 5


def test_refused_token_is_fatal(caplog):
    agent = make_agent()
    agent.client.script("register", FatalError("invalid token: the orchestrator refused it", fix="request a new one"))
    with caplog.at_level(logging.ERROR):
        agent.tick()
    assert agent.exit_code == 1
    assert "invalid token" in caplog.text and "request a new one" in caplog.text
    assert "disconnect" not in agent.client.names()


def test_unreachable_orchestrator_is_retried_with_backoff_forever_when_persistent():
    agent = make_agent()
    agent.client.script("register", TransientError("cannot reach the orchestrator: connection refused"))
    delays = []
    for _ in range(20):
        agent.tick()
        delays.append(agent.register_due - agent.clock.now)
        agent.clock.now = agent.register_due
    assert agent.exit_code is None
    assert delays[0] <= 1 and max(delays) <= 60 and delays[-1] >= 30
    assert agent.clock.now - 100 > EPHEMERAL_GIVE_UP_S  # well past the ephemeral limit, still trying


def test_ephemeral_agent_gives_up_on_an_unreachable_orchestrator():
    agent = make_agent(persistent=False)
    agent.client.script("register", TransientError("cannot reach the orchestrator: connection refused"))
    while agent.exit_code is None and agent.clock.now < 100 + 2 * EPHEMERAL_GIVE_UP_S:
        agent.tick()
        agent.clock.now = agent.register_due or agent.clock.now
    assert agent.exit_code == 1


def test_retry_after_is_honoured():
    agent = make_agent()
    agent.client.script("register", TransientError("HTTP 429", retry_after=45), {"worker_id": "w_1"})
    agent.tick()
    assert agent.register_due - agent.clock.now >= 45


# --- running a job ----------------------------------------------------------------------------


def test_job_acknowledged_then_started_then_completed():
    agent = registered()
    run = submit(agent)
    statuses = [s for _, s, _ in agent.client.reports("j_1")]
    assert statuses == ["starting", "running"]
    assert all(body["attempt"] == "a_1" for _, _, body in agent.client.reports("j_1"))
    assert run.config == {"x": 1}
    run.exit(0)
    pump(agent)
    job_id, status, body = agent.client.reports()[-1]
    assert (job_id, status, body["exit_code"], body["attempt"]) == ("j_1", "completed", 0, "a_1")
    assert agent.job is None and agent.exit_code is None  # persistent: waits for the next job


def test_refused_acknowledgement_never_starts_the_process():
    agent = registered()
    agent.client.script("report:starting", refused("j_1", protocol.STALE_ATTEMPT))
    submit(agent)
    assert FakeRun.instances == []
    assert agent.job is None
    # the same stale dispatch replayed later is ignored without asking again
    submit(agent)
    assert len(agent.client.reports("j_1")) == 1


def test_failed_trainer_reports_exit_code_error_and_log_tail():
    agent = registered()
    run = submit(agent)
    run.emit("epoch 1")
    run.emit("RuntimeError: CUDA out of memory")
    run.exit(3)
    pump(agent)
    _, status, body = agent.client.reports()[-1]
    assert status == "failed" and body["exit_code"] == 3
    assert body["error"] == "Training exited with code 3: RuntimeError: CUDA out of memory"
    assert body["log_tail"].endswith("CUDA out of memory")


def test_killed_trainer_reports_the_signal():
    agent = registered()
    run = submit(agent)
    run.exit(-9)
    pump(agent)
    _, status, body = agent.client.reports()[-1]
    assert status == "failed" and body["exit_code"] == 137 and "killed by SIGKILL" in body["error"]


def test_command_that_cannot_start_is_reported_failed():
    agent = registered()
    original = FakeRun.start

    def broken(self):
        raise FileNotFoundError(2, "No such file or directory")

    FakeRun.start = broken
    try:
        submit(agent)
    finally:
        FakeRun.start = original
    _, status, body = agent.client.reports()[-1]
    assert status == "failed" and "cannot start the training command" in body["error"]
    assert agent.job is None and agent.pending_report is None


def test_progress_reports_are_throttled_to_one_a_second():
    agent = registered()
    run = submit(agent)
    before = len(agent.client.reports())
    for step in range(1, 50):
        run.emit(step=step, total_steps=100)
        agent.tick()
    assert len(agent.client.reports()) == before  # the forced "running" report was just now
    agent.clock.now += 1.0
    agent.tick()
    agent.tick()
    reports = agent.client.reports()
    assert len(reports) == before + 1
    assert reports[-1][2]["progress"] == {"step": 49, "total_steps": 100}
    agent.clock.now += 5
    agent.tick()  # nothing new: nothing sent
    assert len(agent.client.reports()) == before + 1


def test_cancel_stops_the_job_and_reports_cancelled():
    agent = registered()
    run = submit(agent)
    agent.on_event(Event("job_cancel", '{"type": "job_cancel", "job_id": "j_1", "attempt": "a_1"}'))
    assert run.stop_reason == STOP_CANCEL and run.signals == ["TERM"]
    run.exit(-15)
    pump(agent)
    _, status, body = agent.client.reports()[-1]
    assert status == "cancelled" and body["exit_code"] == 143


def test_cancel_of_another_job_is_ignored():
    agent = registered()
    run = submit(agent)
    agent.on_event(Event("job_cancel", '{"type": "job_cancel", "job_id": "j_other"}'))
    assert run.stop_reason is None


def test_result_is_retried_until_delivered_and_heartbeats_name_the_job_meanwhile():
    agent = registered()
    run = submit(agent)
    agent.client.script("report:completed", TransientError("HTTP 503"), TransientError("HTTP 503"), {"accepted": True})
    run.exit(0)
    pump(agent)
    assert agent.pending_report is not None
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    heartbeat = [c for c in agent.client.calls if c[0] == "heartbeat"][-1][1]
    assert heartbeat["current_job_id"] == "j_1" and heartbeat["status"] == "busy"
    for _ in range(5):
        agent.clock.now = max(agent.report_due or agent.clock.now, agent.clock.now)
        agent.tick()
    assert agent.pending_report is None
    assert [s for _, s, _ in agent.client.reports("j_1")].count("completed") == 3


def test_stale_heartbeat_abandons_the_job_without_reporting_it():
    agent = registered()
    run = submit(agent)
    agent.client.script("heartbeat", refused("j_1"))
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    assert run.stop_reason == STOP_ABANDON
    run.exit(-15)
    pump(agent)
    assert [s for _, s, _ in agent.client.reports("j_1")] == ["starting", "running"]
    assert agent.job is None and agent.exit_code is None


def test_refused_progress_report_abandons():
    agent = registered()
    run = submit(agent)
    agent.client.script("report:running", refused("j_1", protocol.STALE_ATTEMPT))
    run.emit(step=1)
    agent.clock.now += 2
    agent.tick()
    assert run.stop_reason == STOP_ABANDON


def test_duplicate_and_replayed_dispatches_are_ignored():
    agent = registered()
    run = submit(agent)
    submit(agent)  # redelivered
    assert len(FakeRun.instances) == 1
    run.exit(0)
    pump(agent)
    submit(agent)  # replayed after a reconnect: that attempt is over
    assert len(FakeRun.instances) == 1


def test_a_job_arriving_while_busy_starts_next():
    agent = registered()
    first = submit(agent)
    submit(agent, job_id="j_2", attempt="a_2")
    assert len(FakeRun.instances) == 1
    first.exit(0)
    pump(agent)
    assert FakeRun.instances[-1].job_id == "j_2" and agent.job is FakeRun.instances[-1]


# --- reconnect and reconciliation -------------------------------------------------------------


def test_after_a_dropped_stream_it_registers_again_reporting_its_job_and_resumes():
    agent = registered()
    run = submit(agent)
    agent.handle(("stream_lost", "connection lost", 120.0))
    assert not agent.registered and agent.register_due == agent.clock.now
    agent.client.script("register", {"worker_id": "w_1", "resume_job": {"job_id": "j_1", "attempt": "a_2"}})
    agent.tick()
    body = [c for c in agent.client.calls if c[0] == "register"][-1][1]
    assert body["current_job_id"] == "j_1"
    assert run.stop_reason is None and run.attempt == "a_2"
    assert agent.stream.opened == 2


def test_abandon_job_on_register_stops_it_silently():
    agent = registered()
    run = submit(agent)
    agent.handle(("stream_lost", "connection lost", 120.0))
    agent.client.script("register", {"worker_id": "w_1", "abandon_job": "j_1"})
    agent.tick()
    assert run.stop_reason == STOP_ABANDON
    run.exit(-15)
    pump(agent)
    assert [s for _, s, _ in agent.client.reports("j_1")] == ["starting", "running"]


def test_quickly_dropping_streams_back_off():
    agent = registered()
    agent.handle(("stream_lost", "closed", 0.5))
    first = agent.register_due - agent.clock.now
    agent.tick()
    agent.clock.now = agent.register_due
    agent.tick()
    agent.handle(("stream_lost", "closed", 0.5))
    assert first > 0 and agent.register_due - agent.clock.now > 0


# --- drain, ephemeral, signals, shutdown --------------------------------------------------------


def test_ephemeral_exits_after_its_job_is_reported():
    agent = registered(persistent=False)
    run = submit(agent)
    run.exit(0)
    pump(agent)
    assert agent.client.names()[-1] == "disconnect"
    assert agent.exit_code == 0


def test_drain_finishes_the_job_then_persistent_stays_and_ephemeral_leaves():
    for persistent, expected in ((True, None), (False, 0)):
        agent = registered(persistent=persistent)
        run = submit(agent)
        agent.on_event(Event("drain", '{"type": "drain"}'))
        assert run.stop_reason is None and agent.exit_code is None
        submit(agent, job_id="j_2", attempt="a_2")  # dispatched just before the drain
        run.exit(0)
        pump(agent)
        assert agent.exit_code == expected


def test_idle_persistent_worker_stays_draining_and_drain_survives_registration():
    agent = registered()
    agent.client.script("register", {"worker_id": "w_1", "draining": True})
    agent.handle(("stream_lost", "closed", 60.0))
    agent.tick()
    assert agent.draining and agent.exit_code is None


def test_heartbeat_saying_draining_drains():
    agent = registered(persistent=False)
    agent.client.script("heartbeat", {"status": "draining", "draining": True})
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    assert agent.exit_code == 0


def test_first_signal_finishes_the_job_then_exits():
    agent = registered()
    run = submit(agent)
    agent.handle(("signal", signal.SIGTERM))
    assert run.stop_reason is None and agent.exit_code is None
    submit(agent, job_id="j_2", attempt="a_2")
    run.exit(0)
    pump(agent)
    assert len(FakeRun.instances) == 1  # no new job after the signal
    assert agent.client.reports()[-1][1] == "completed"
    assert agent.client.names()[-1] == "disconnect" and agent.exit_code == 0


def test_second_signal_stops_the_job_now_and_disconnects_to_hand_it_back():
    agent = registered()
    run = submit(agent)
    agent.handle(("signal", signal.SIGTERM))
    agent.handle(("signal", signal.SIGINT))
    assert run.stop_reason == STOP_AGENT_EXIT
    run.exit(-15)
    pump(agent)
    assert [s for _, s, _ in agent.client.reports("j_1")] == ["starting", "running"]
    assert agent.client.names()[-1] == "disconnect"
    assert agent.exit_code == 0


def test_report_refused_because_the_job_was_cancelled_stops_and_reports_it_cancelled():
    agent = registered()
    run = submit(agent)
    agent.client.script("report:running", refused("j_1", protocol.JOB_CANCELLED))
    run.emit(step=1)
    agent.clock.now += 2
    agent.tick()
    assert run.stop_reason == STOP_CANCEL
    agent.on_event(Event("job_cancel", '{"type": "job_cancel", "job_id": "j_1"}'))  # the event too: no second stop
    assert run.signals == ["TERM"]
    run.exit(143)
    pump(agent)
    _, status, body = agent.client.reports()[-1]
    assert status == "cancelled" and body["exit_code"] == 143


def test_third_signal_kills_and_exits():
    agent = registered()
    run = submit(agent)
    for _ in range(3):
        agent.handle(("signal", signal.SIGTERM))
    assert run.killed and agent.exit_code == 1


def test_idle_signal_disconnects_and_exits_zero():
    agent = registered()
    agent.handle(("signal", signal.SIGINT))
    assert agent.client.names()[-1] == "disconnect" and agent.exit_code == 0


def shut_down(agent, caplog, **payload):
    """Deliver a shutdown event with ``payload``; return the one error line the agent logged."""
    with caplog.at_level(logging.ERROR):
        agent.on_event(Event(protocol.SHUTDOWN, json.dumps({"type": protocol.SHUTDOWN, **payload})))
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    return line


def test_shutdown_for_a_revoked_token_is_fatal_with_the_new_token_fix(caplog):
    agent = registered()
    line = shut_down(agent, caplog, reason="token rotated", code=protocol.TOKEN_REVOKED)
    assert agent.exit_code == 1 and "disconnect" not in agent.client.names()
    assert line.startswith("the orchestrator closed this worker's stream: token rotated. Fix: ")
    assert "request a new token" in line and "rotate token" in line and "deleted" not in line


def test_shutdown_for_a_deleted_worker_is_fatal_with_the_new_worker_fix(caplog):
    agent = registered()
    # the reason's words do not decide: only the code does
    line = shut_down(agent, caplog, reason="its token no longer works", code=protocol.WORKER_DELETED)
    assert agent.exit_code == 1 and "disconnect" not in agent.client.names()
    assert line.startswith("the orchestrator closed this worker's stream: its token no longer works. Fix: ")
    assert "was deleted" in line and "create a new one" in line and "rotate token" not in line


@pytest.mark.parametrize("code", [None, "", "something_new", ["token_revoked"]])
def test_shutdown_without_a_known_code_shows_only_the_reason(caplog, code):
    agent = registered()
    payload = {"reason": "token revoked, worker deleted"}  # the words the agent once guessed from
    if code is not None:
        payload["code"] = code
    line = shut_down(agent, caplog, **payload)
    assert agent.exit_code == 1
    assert line == "the orchestrator closed this worker's stream: token revoked, worker deleted"


def test_shutdown_without_a_reason_says_so(caplog):
    agent = registered()
    line = shut_down(agent, caplog)
    assert agent.exit_code == 1 and line == "the orchestrator closed this worker's stream: no reason given"


def test_fatal_error_from_the_stream_exits():
    agent = registered()
    agent.handle(("fatal", FatalError("invalid token")))
    assert agent.exit_code == 1


@pytest.mark.parametrize("data", ["", "not json", "[1, 2]", '{"type": "ping"}', '{"type": "stream-open"}'])
def test_keepalives_and_unknown_events_are_harmless(data):
    agent = registered()
    agent.on_event(Event("message", data))
    assert agent.exit_code is None and agent.job is None
