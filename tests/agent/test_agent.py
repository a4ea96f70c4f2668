"""The agent's decisions, driven message by message with a fake orchestrator, clock, monitor and job."""

import json
import logging
import signal
from pathlib import Path

import pytest

from worker_agent import protocol
from worker_agent.agent import Agent
from worker_agent.cli import AgentConfig
from worker_agent.client import FatalError, Refused, TransientError
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


WORK_DIR = None  # each test's own (tmp_path), set by the autouse fixture below


@pytest.fixture(autouse=True)
def work_dir(tmp_path):
    global WORK_DIR
    WORK_DIR = tmp_path / "jobs"
    WORK_DIR.mkdir()
    yield WORK_DIR
    WORK_DIR = None


def make_agent(*, persistent=True, command="python train.py", client=None, token="wt_x", monitor=None, gpus=None, advertise_address=None):
    config = AgentConfig(
        orchestrator_url="http://orch:8001",
        token=token,
        name="gpu-1",
        persistent=persistent,
        verify=True,
        work_dir=Path(WORK_DIR),
        command=command,
        heartbeat_interval=None,
        cancel_grace=30.0,
        gpus=gpus,
        advertise_address=advertise_address,
    )
    FakeRun.instances.clear()
    agent = Agent(
        config, client=client or FakeClient(), monitor=monitor or FakeMonitor(), clock=Clock(), run_factory=FakeRun, stream=FakeStream()
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
    assert body == {"status": "busy", "current_job_id": "j_1", "attempt": "a_1", "progress": {"step": 3}, "cpu_percent": 5.0}


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


def test_the_run_gets_the_attempts_upload_endpoint_token_and_resume():
    agent = registered()
    resume = {"step": 20, "checkpoint": "checkpoint-20", "attempt": 1, "files": []}
    run = submit(agent, upload_endpoint=protocol.UPLOAD_PATH, upload_token="stu_a_1:sig", resume=resume)
    assert run.transfer.endpoint_url == "http://orch:8001/api/cloud/storage"
    assert run.transfer.token == "stu_a_1:sig" and run.resume == resume
    bare = submit(agent, job_id="j_2", attempt="a_2")  # no token (an orchestrator without an artifact store)
    assert bare is run  # queued behind j_1; checked when it starts
    run.exit(0)
    pump(agent)
    assert FakeRun.instances[-1].job_id == "j_2" and FakeRun.instances[-1].transfer is None


def test_a_run_whose_outputs_could_not_be_uploaded_is_reported_failed():
    agent = registered()
    run = submit(agent, upload_endpoint=protocol.UPLOAD_PATH, upload_token="stu_a_1:sig")
    run.upload_error = "PUT ... refused: HTTP 413 quota"
    run.exit(0)
    pump(agent)
    _, status, body = agent.client.reports("j_1")[-1]
    assert status == "failed" and "could not be uploaded" in body["error"] and body["exit_code"] == 0


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


def test_a_heartbeat_saying_not_draining_any_more_puts_the_agent_back_in_service(caplog):
    agent = registered()
    agent.client.script("heartbeat", {"status": "draining", "draining": True})
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    assert agent.draining
    agent.client.script("heartbeat", {"status": "idle", "draining": False})
    agent.clock.now = agent.next_heartbeat
    with caplog.at_level("INFO"):
        agent.tick()
    assert not agent.draining and agent.exit_code is None
    assert "Back in service: this worker takes jobs again" in caplog.text


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


def test_another_agent_taking_the_worker_over_stops_this_one_saying_who(caplog):
    agent = registered()
    run = submit(agent)
    line = shut_down(
        agent, caplog, reason="another agent took this worker over", code=protocol.AGENT_REPLACED, agent_name="gpu-b",
        agent_host="node-7",
    )
    assert agent.exit_code == 1 and "disconnect" not in agent.client.names()  # the worker is the other agent's now
    assert line.startswith("another agent took this worker over with the same token (gpu-b on node-7); this agent stops. Fix: ")
    assert "one agent per worker" in line
    agent._shut_down()
    assert run.stop_reason == STOP_AGENT_EXIT and agent.client.reports("j_1")[-1][1] == "running"  # stopped, not reported


def test_an_agent_taken_over_while_its_link_was_cut_stops_when_its_registration_is_refused(caplog):
    agent = registered()
    agent.handle(("stream_lost", "connection lost", 120.0))
    detail = "another agent took this worker over with the same token (gpu-b on node-7); this agent stops"
    agent.client.script("register", Refused(detail, code=protocol.AGENT_REPLACED))
    with caplog.at_level(logging.ERROR):
        agent.tick()
    assert agent.exit_code == 1 and "disconnect" not in agent.client.names()
    (line,) = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert line.startswith(detail + ". Fix: run one agent per worker")


def test_the_agent_sends_its_own_instance_on_every_request():
    config = AgentConfig(
        orchestrator_url="http://orch:8001", token="wt_x", name="gpu-1", persistent=True, verify=True,
        work_dir=Path(WORK_DIR), command="python train.py", heartbeat_interval=None, cancel_grace=30.0,
    )
    first, second = Agent(config, monitor=FakeMonitor()), Agent(config, monitor=FakeMonitor())
    header = first.client.session.headers[protocol.AGENT_INSTANCE_HEADER]
    assert header == first.instance and len(header) == 32 and second.instance != first.instance


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


# --- acknowledgement before the trainer starts ----------------------------------------------------


def heartbeats(agent):
    return [c[1] for c in agent.client.calls if c[0] == "heartbeat"]


def registrations(agent):
    return [c[1] for c in agent.client.calls if c[0] == "register"]


def run_until(agent, condition, *, limit=600.0):
    """Advance the fake clock to each next due time and tick, until ``condition()`` or ``limit`` seconds pass."""
    end = agent.clock.now + limit
    while not condition() and agent.exit_code is None and agent.clock.now < end:
        agent.clock.now += max(agent._wait_time(), 0.01)
        agent.tick()
        pump(agent)
    return condition()


def test_trainer_starts_only_after_the_starting_report_is_accepted():
    agent = registered()
    seen = []
    original = agent.client.report

    def report(job_id, body):
        seen.append((body["status"], len(FakeRun.instances)))
        return original(job_id, body)

    agent.client.report = report
    run = submit(agent)
    assert seen[0] == ("starting", 0)  # the acknowledgement went out before any trainer existed
    assert run is not None and run.running and agent.job is run and agent.pending_ack is None


def test_acknowledgement_failing_then_accepted_within_the_deadline_starts_the_trainer_once():
    agent = registered()
    agent.client.script(
        "report:starting",
        TransientError("cannot reach the orchestrator: connection refused"),
        TransientError("HTTP 503"),
        {"accepted": True},
    )
    assert submit(agent) is None
    assert agent.pending_ack is not None and agent.job is None
    assert run_until(agent, lambda: agent.job is not None, limit=59)
    assert len(FakeRun.instances) == 1
    statuses = [s for _, s, _ in agent.client.reports("j_1")]
    assert statuses == ["starting", "starting", "starting", "running"]
    assert all(body["attempt"] == "a_1" for _, _, body in agent.client.reports("j_1"))
    # the same dispatch delivered again (a replay after the reconnect) starts nothing more
    submit(agent)
    run_until(agent, lambda: False, limit=30)
    assert len(FakeRun.instances) == 1


def test_unacknowledged_dispatch_is_given_up_at_the_servers_deadline_without_running_or_reporting(caplog):
    agent = make_agent()
    agent.client.script("register", {"worker_id": "w_1", "heartbeat_interval": 30, "dispatch_ack_timeout": 20})
    agent.tick()
    agent.client.script("report:starting", TransientError("HTTP 503"))
    agent.client.script("heartbeat", TransientError("HTTP 503"))
    received = agent.clock.now
    with caplog.at_level(logging.INFO):
        submit(agent)
        run_until(agent, lambda: agent.clock.now >= received + 18.5, limit=25)
        assert agent.clock.now < received + 20 and agent.pending_ack is not None  # not yet
        run_until(agent, lambda: agent.pending_ack is None, limit=5)
    assert agent.clock.now == pytest.approx(received + 20, abs=0.02)
    assert FakeRun.instances == [] and agent.job is None
    assert {s for _, s, _ in agent.client.reports()} == {"starting"}
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Job j_1 not started")]
    assert lines == ["Job j_1 not started: its dispatch (attempt a_1) was not acknowledged within 20s; the orchestrator requeues it"]
    # it says so: registering again without the job, and heartbeats name no job any more
    agent.tick()
    assert registrations(agent)[-1]["current_job_id"] is None
    agent.client.script("heartbeat", {"status": "idle", "current_job_id": None})
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    assert heartbeats(agent)[-1]["current_job_id"] is None
    # a replay of that dispatch is ignored
    submit(agent)
    assert FakeRun.instances == [] and agent.pending_ack is None


def test_acknowledgement_deadline_defaults_to_60_seconds_without_the_servers_value():
    agent = registered()  # the fake's register response has no dispatch_ack_timeout (like the upstream server)
    agent.client.script("report:starting", TransientError("HTTP 502"))
    agent.client.script("heartbeat", TransientError("HTTP 502"))
    received = agent.clock.now
    submit(agent)
    run_until(agent, lambda: agent.pending_ack is None, limit=120)
    assert agent.clock.now == pytest.approx(received + 60, abs=0.02)
    assert FakeRun.instances == []


def test_acknowledgement_retries_honour_retry_after():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 429", retry_after=7), {"accepted": True})
    submit(agent)
    assert agent.pending_ack.due - agent.clock.now >= 7


def test_heartbeat_naming_the_dispatch_acknowledges_it():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"))
    agent.heartbeat_interval = 5.0
    agent.next_heartbeat = agent.clock.now + 5
    submit(agent)
    agent.client.script("heartbeat", {"status": "busy", "draining": False, "current_job_id": None})
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    body = heartbeats(agent)[-1]
    assert (body["status"], body["current_job_id"], body["attempt"]) == ("busy", "j_1", "a_1")
    assert agent.job is None and agent.pending_ack is not None  # not said to be ours: no acknowledgement
    agent.client.script("heartbeat", {"status": "busy", "draining": False, "current_job_id": "j_1"})
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    assert len(FakeRun.instances) == 1 and agent.job is FakeRun.instances[0] and agent.pending_ack is None
    assert [s for _, s, _ in agent.client.reports("j_1")][-1] == "running"


def test_heartbeat_holding_the_job_under_another_attempt_is_no_acknowledgement():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"))
    agent.heartbeat_interval = 5.0
    agent.next_heartbeat = agent.clock.now + 5
    submit(agent)
    # The server holds j_1 for this worker, but under a newer attempt: it did not acknowledge ours.
    agent.client.script(
        "heartbeat", {"status": "busy", "draining": False, "current_job_id": "j_1", "current_attempt": "a_2"}
    )
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    assert FakeRun.instances == [] and agent.pending_ack is not None
    agent.client.script(
        "heartbeat", {"status": "busy", "draining": False, "current_job_id": "j_1", "current_attempt": "a_1"}
    )
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    assert len(FakeRun.instances) == 1 and agent.pending_ack is None


def test_heartbeat_refusing_the_dispatch_drops_it():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"))
    submit(agent)
    agent.client.script("heartbeat", refused("j_1"))
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    assert agent.pending_ack is None and FakeRun.instances == []
    run_until(agent, lambda: False, limit=90)
    assert FakeRun.instances == [] and {s for _, s, _ in agent.client.reports()} == {"starting"}


def test_reregistering_naming_the_dispatch_and_resumed_acknowledges_it():
    agent = registered()
    agent.client.script("report:starting", TransientError("cannot reach the orchestrator: connection refused"))
    submit(agent)
    agent.handle(("stream_lost", "connection lost", 120.0))
    agent.client.script("register", {"worker_id": "w_1", "resume_job": {"job_id": "j_1", "attempt": "a_1"}})
    agent.tick()
    body = registrations(agent)[-1]
    assert (body["current_job_id"], body["current_attempt"]) == ("j_1", "a_1")
    assert len(FakeRun.instances) == 1 and agent.job is FakeRun.instances[0] and agent.job.attempt == "a_1"
    assert agent.stream.opened == 2


def test_resume_of_another_attempt_does_not_acknowledge_the_dispatch():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"))
    submit(agent)
    agent.handle(("stream_lost", "connection lost", 120.0))
    agent.client.script("register", {"worker_id": "w_1", "resume_job": {"job_id": "j_1", "attempt": "a_2"}})
    agent.tick()
    assert FakeRun.instances == [] and agent.pending_ack is not None


def test_reregistering_answered_with_abandon_drops_the_dispatch():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"))
    submit(agent)
    agent.handle(("stream_lost", "connection lost", 120.0))
    agent.client.script("register", {"worker_id": "w_1", "abandon_job": "j_1"})
    agent.tick()
    assert agent.pending_ack is None and FakeRun.instances == []


def test_refusal_on_a_retried_acknowledgement_drops_the_dispatch_and_the_next_one_is_acknowledged():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"), refused("j_1", protocol.STALE_ATTEMPT), {"accepted": True})
    submit(agent)
    submit(agent, job_id="j_2", attempt="a_2")  # arrived while j_1 waits: it is next
    run_until(agent, lambda: agent.job is not None, limit=30)
    assert [run.job_id for run in FakeRun.instances] == ["j_2"]
    assert [(j, s) for j, s, _ in agent.client.reports()][:3] == [("j_1", "starting"), ("j_1", "starting"), ("j_2", "starting")]


def test_rejected_acknowledgement_does_not_start_the_trainer():
    from worker_agent.client import Rejected

    agent = registered()
    agent.client.script("report:starting", Rejected("POST /api/workers/job/j_1/status: HTTP 404", status=404))
    submit(agent)
    assert agent.pending_ack is None and FakeRun.instances == []


def test_cancel_before_acknowledgement_reports_cancelled_and_never_starts():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"))
    submit(agent)
    agent.on_event(Event("job_cancel", '{"type": "job_cancel", "job_id": "j_1", "attempt": "a_1"}'))
    assert agent.pending_ack is None and FakeRun.instances == []
    assert agent.client.reports()[-1][1] == "cancelled"
    assert not (WORK_DIR / "w_1" / "j_1").exists()  # nothing ran: nothing journaled
    run_until(agent, lambda: False, limit=90)
    assert FakeRun.instances == []


def test_a_new_attempt_of_the_awaited_job_replaces_the_old_dispatch():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"), {"accepted": True})
    submit(agent)
    submit(agent, attempt="a_2")
    assert agent.job is not None and agent.job.attempt == "a_2" and len(FakeRun.instances) == 1
    submit(agent)  # the old one replayed: over
    assert len(FakeRun.instances) == 1


# --- the outcome journal --------------------------------------------------------------------------


def outcome(job_id="j_1"):
    return WORK_DIR / "w_1" / job_id / "outcome.json"  # the job dirs of the worker (w_1) it was dispatched to


def reported_outcome(job_id="j_1"):
    return WORK_DIR / "w_1" / job_id / "outcome.reported.json"


def test_result_is_journaled_before_it_is_reported_and_marked_once_answered():
    agent = registered()
    run = submit(agent)
    on_disk_at_report = []
    original = agent.client.report

    def report(job_id, body):
        if body["status"] == "completed":
            on_disk_at_report.append(json.loads(outcome(job_id).read_text()))
        return original(job_id, body)

    agent.client.report = report
    run.emit("loss 0.1", step=10, total_steps=10)
    run.exit(0)
    pump(agent)
    (record,) = on_disk_at_report
    sent = agent.client.reports("j_1")[-1][2]
    assert record["job_id"] == "j_1" and record["report"] == sent
    assert (sent["status"], sent["attempt"], sent["exit_code"]) == ("completed", "a_1", 0)
    assert sent["progress"] == {"step": 10, "total_steps": 10} and sent["log_tail"] == "loss 0.1"
    assert not outcome().exists() and json.loads(reported_outcome().read_text())["report"] == sent
    assert not list((WORK_DIR / "w_1" / "j_1").glob(".*tmp"))


@pytest.mark.parametrize("answer", [refused("j_1", protocol.STALE_ATTEMPT), {"accepted": True}])
def test_an_answered_result_is_marked_delivered(answer):
    agent = registered()
    run = submit(agent)
    agent.client.script("report:failed", answer)
    run.exit(3)
    pump(agent)
    assert agent.pending_report is None
    assert not outcome().exists() and reported_outcome().exists()


def _rejected(status=400):
    from worker_agent.client import Rejected

    return Rejected(f"POST /api/workers/job/j_1/status: HTTP {status}: The request is invalid; see errors.", status=status)


@pytest.mark.parametrize("status", [400, 413])
def test_a_rejected_result_is_reported_once_more_in_its_minimal_form_and_the_job_ends(status):
    agent = registered()
    run = submit(agent)
    run.emit("RuntimeError: bad\x00byte", step=3, loss=float("nan"))
    agent.client.script("report:failed", _rejected(status), {"accepted": True})
    run.exit(0xC0000005)
    pump(agent)
    (_, _, first), (_, _, second) = agent.client.reports("j_1")[-2:]
    assert "log_tail" in first and "progress" in first
    assert second == {
        "status": "failed",
        "attempt": "a_1",
        "exit_code": 0xC0000005,
        "error": "Training exited with code 3221225477: RuntimeError: bad\ufffdbyte",
    }
    assert agent.pending_report is None
    assert not outcome().exists() and reported_outcome().exists()
    assert [status for _, status, _ in agent.client.reports("j_1")] == ["starting", "running", "failed", "failed"]


def test_a_result_rejected_twice_is_given_up_after_the_minimal_form():
    agent = registered()
    run = submit(agent)
    agent.client.script("report:completed", _rejected())
    run.exit(0)
    pump(agent)
    assert [status for _, status, _ in agent.client.reports("j_1")] == ["starting", "running", "completed", "completed"]
    assert agent.pending_report is None and reported_outcome().exists()


def test_a_rejected_progress_report_is_not_retried_in_minimal_form():
    agent = registered()
    run = submit(agent)
    agent.client.script("report:running", _rejected())
    run.emit("line", step=1)
    agent.report_progress(agent.slots["j_1"], force=True)
    assert [status for _, status, _ in agent.client.reports("j_1")] == ["starting", "running", "running"]
    assert agent.job is run


def test_a_journaled_result_rejected_is_reported_minimal_and_still_says_journal():
    agent = registered()
    run = submit(agent)
    agent.client.script("report:cancelled", TransientError("HTTP 503"))
    run.stop(STOP_CANCEL)
    run.exit(-15)
    pump(agent)
    again = make_agent()
    again.client.script("report:cancelled", _rejected(), {"accepted": True})
    run_until(again, lambda: again.registered, limit=60)
    (_, _, first), (_, _, second) = again.client.reports("j_1")[:2]
    assert first["journal"] is True and "log_tail" in first
    assert second == {"status": "cancelled", "attempt": "a_1", "exit_code": 143, "error": "cancelled by the orchestrator", "journal": True}
    assert reported_outcome().exists()


def test_agent_recreated_after_an_undelivered_result_reports_it_with_its_attempt_before_registering():
    agent = registered()
    run = submit(agent)
    agent.client.script("report:completed", TransientError("cannot reach the orchestrator: connection refused"))
    run.emit("done", step=5, total_steps=5)
    run.exit(0)
    pump(agent)
    assert agent.pending_report is not None and outcome().exists()
    sent = agent.client.reports("j_1")[-1][2]
    # the agent dies here (kill -9): only the journal remains
    again = make_agent()
    assert again.current_job_id() is None
    again.client.script("report:completed", TransientError("HTTP 503"), {"accepted": True})
    again.tick()
    assert again.client.names() == ["report"]  # first try failed: not registered meanwhile
    assert outcome().exists()
    run_until(again, lambda: again.registered, limit=60)
    names = again.client.names()
    assert names == ["report", "report", "register"]
    (first, body), second = again.client.calls[0][1:], again.client.calls[1][1:]
    assert first == "j_1" and body == {**sent, "journal": True} and body["attempt"] == "a_1" and second[1] == body
    assert registrations(again)[0]["current_job_id"] is None
    assert not outcome().exists() and reported_outcome().exists()
    # that attempt is over for this agent: its dispatch replayed is ignored
    submit(again)
    assert FakeRun.instances == []


def test_journaled_results_survive_an_unreadable_neighbour(caplog):
    (WORK_DIR / "j_bad").mkdir()
    (WORK_DIR / "j_bad" / "outcome.json").write_text("{not json")
    from worker_agent import journal

    journal.write_outcome(WORK_DIR / "j_ok", "j_ok", {"status": "failed", "attempt": "a_9", "exit_code": 1})
    with caplog.at_level(logging.WARNING):
        agent = make_agent()
        agent.tick()
    assert agent.client.reports() == [("j_ok", "failed", {"status": "failed", "attempt": "a_9", "exit_code": 1, "journal": True})]
    assert agent.registered and "Ignoring an unreadable job outcome" in caplog.text
    assert (WORK_DIR / "j_bad" / "outcome.json").exists()  # left for an operator


def test_result_held_after_a_dropped_stream_is_reported_before_registering_again():
    agent = registered()
    run = submit(agent)
    agent.client.script("report:completed", TransientError("HTTP 503"), {"accepted": True})
    run.exit(0)
    pump(agent)
    agent.handle(("stream_lost", "connection lost", 120.0))
    before = len(agent.client.calls)
    run_until(agent, lambda: agent.registered, limit=60)
    tail = [c[0] if c[0] != "report" else c[2]["status"] for c in agent.client.calls[before:] if c[0] != "heartbeat"]
    assert tail == ["completed", "register"]
    assert "journal" not in agent.client.reports("j_1")[-1][2]  # held in memory: not read back from disk
    assert registrations(agent)[-1]["current_job_id"] is None
    assert not outcome().exists()


def test_heartbeat_refusal_of_a_held_result_tries_the_report_once_more():
    agent = registered()
    run = submit(agent)
    agent.client.script("report:completed", TransientError("HTTP 503"), {"accepted": True})
    run.exit(0)
    pump(agent)
    agent.client.script("heartbeat", refused("j_1"))
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    assert [s for _, s, _ in agent.client.reports("j_1")].count("completed") == 2
    assert agent.pending_report is None and reported_outcome().exists()


# --- stopping: SIGTERM in every state exits within seconds (fake clock: no time passes) --------


def test_sigterm_while_registering_with_backoff_exits_at_once():
    agent = make_agent()
    agent.client.script("register", TransientError("cannot reach the orchestrator: connection refused"))
    for _ in range(6):
        agent.tick()
        agent.clock.now = agent.register_due
    assert agent.register_due - agent.clock.now >= 0 and agent.exit_code is None
    start = agent.clock.now
    agent.handle(("signal", signal.SIGTERM))
    assert agent.exit_code == 0 and agent.clock.now == start
    assert "disconnect" not in agent.client.names()  # never registered: nothing to end


def test_sigterm_while_reconnecting_exits_at_once():
    agent = registered()
    agent.client.script("register", TransientError("cannot reach the orchestrator: connection refused"))
    agent.handle(("stream_lost", "connection lost", 1.0))
    run_until(agent, lambda: False, limit=30)
    agent.client.script("disconnect", TransientError("cannot reach the orchestrator: connection refused"))
    start = agent.clock.now
    agent.handle(("signal", signal.SIGTERM))
    assert agent.exit_code == 0 and agent.clock.now == start
    assert ("stopping",) in agent.client.calls  # its last calls use the short timeouts


def test_sigterm_while_awaiting_the_acknowledgement_gives_the_job_up_and_exits():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"))
    submit(agent)
    start = agent.clock.now
    agent.handle(("signal", signal.SIGTERM))
    assert agent.exit_code == 0 and agent.clock.now == start
    assert FakeRun.instances == [] and agent.pending_ack is None
    assert agent.client.names()[-1] == "disconnect"  # hands the dispatch back at once
    assert {s for _, s, _ in agent.client.reports()} == {"starting"}


def test_sigterm_with_an_undeliverable_result_exits_keeping_it_on_disk():
    agent = registered()
    run = submit(agent)
    agent.client.script("report:completed", TransientError("cannot reach the orchestrator: connection refused"))
    run.exit(0)
    pump(agent)
    start = agent.clock.now
    agent.handle(("signal", signal.SIGTERM))
    assert agent.exit_code == 0 and agent.clock.now == start
    assert [s for _, s, _ in agent.client.reports("j_1")].count("completed") == 2  # one more try
    assert "disconnect" not in agent.client.names()  # the job stays this worker's until the next start reports it
    assert outcome().exists()


def test_sigterm_with_a_result_delivered_at_the_last_try_disconnects():
    agent = registered()
    run = submit(agent)
    agent.client.script("report:completed", TransientError("HTTP 503"), {"accepted": True})
    run.exit(0)
    pump(agent)
    agent.handle(("signal", signal.SIGTERM))
    assert agent.exit_code == 0 and agent.client.names()[-1] == "disconnect"
    assert reported_outcome().exists()


def test_first_sigterm_lets_the_trainer_finish_then_exits_without_waiting_on_an_unreachable_orchestrator():
    agent = registered()
    run = submit(agent)
    agent.handle(("signal", signal.SIGTERM))
    assert agent.exit_code is None and run.stop_reason is None
    agent.client.script("report:completed", TransientError("cannot reach the orchestrator: connection refused"))
    run.exit(0)
    pump(agent)
    assert agent.exit_code == 0 and outcome().exists()


def blocked_then_interrupted(agent):
    """A request that blocks until SIGTERM arrives: the handler runs in the middle of it (as on the main thread)."""

    def blocked():
        agent.on_os_signal(signal.SIGTERM)
        raise AssertionError("the signal handler did not interrupt the blocked request")

    return blocked


def test_sigterm_interrupts_a_request_blocked_on_an_unresponsive_orchestrator():
    from worker_agent.client import STOPPING_TIMEOUT, OrchestratorClient

    from .fakes import FakeResponse, FakeSession

    session = FakeSession(FakeResponse(200, {"worker_id": "w_1", "heartbeat_interval": 30}))
    agent = make_agent(client=OrchestratorClient("http://orch:8001", "wt_x", session=session))
    agent.tick()
    assert agent.registered
    session.script += [blocked_then_interrupted(agent), FakeResponse(200, {"status": "offline"})]
    agent.clock.now = agent.next_heartbeat
    start = agent.clock.now
    agent.tick()  # the heartbeat blocks; SIGTERM breaks it (a transient failure) instead of its timeout
    assert agent.heartbeat_failing and agent.exit_code is None
    pump(agent)
    assert agent.exit_code == 0 and agent.clock.now == start
    assert session.calls[-1]["url"].endswith("/api/workers/disconnect")
    assert session.calls[-1]["timeout"] == STOPPING_TIMEOUT


def test_first_sigterm_does_not_interrupt_calls_while_a_trainer_runs():
    from worker_agent.client import Interrupted

    agent = registered()
    submit(agent)
    interrupted = []
    agent.client.interrupt = lambda force=False: interrupted.append(1)
    agent.on_os_signal(signal.SIGTERM)
    assert interrupted == []  # it keeps running the job: nothing to hurry
    agent.on_os_signal(signal.SIGTERM)
    assert interrupted == [1]  # the second stops the job now
    assert Interrupted.__mro__[1] is BaseException


def test_a_second_signal_without_a_trainer_lets_the_goodbye_finish():
    """`simpletuner server` sends its agent a second SIGTERM 0.5 s after the first: an idle agent whose
    disconnect is still in flight then must not cut it short (the worker would stay online until its
    heartbeat timeout). A third signal still breaks the call."""
    from worker_agent.client import STOPPING_TIMEOUT, OrchestratorClient

    from .fakes import FakeResponse, FakeSession

    session = FakeSession(FakeResponse(200, {"worker_id": "w_1", "heartbeat_interval": 30}))
    agent = make_agent(client=OrchestratorClient("http://orch:8001", "wt_x", session=session))
    agent.tick()

    def second_signal_mid_disconnect():
        agent.on_os_signal(signal.SIGTERM)  # would raise Interrupted into this call if it cut it short
        return FakeResponse(200, {"status": "offline"})

    session.script.append(second_signal_mid_disconnect)
    agent.on_os_signal(signal.SIGTERM)  # idle, outside a call: nothing to break
    pump(agent)
    assert session.calls[-1]["url"].endswith("/api/workers/disconnect")
    assert session.calls[-1]["timeout"] == STOPPING_TIMEOUT
    assert agent.exit_code == 0  # heard, and the second signal did not turn it into "exiting now"


def test_a_first_signal_mid_registration_lets_it_finish_and_then_disconnects():
    """Registered by the orchestrator but not told yet: cutting the call short would leave the worker online
    with an agent that cannot say goodbye (it learns its worker id from the answer)."""
    from worker_agent.client import STOPPING_TIMEOUT, OrchestratorClient

    from .fakes import FakeResponse, FakeSession

    session = FakeSession()
    agent = make_agent(client=OrchestratorClient("http://orch:8001", "wt_x", session=session))

    def signalled_mid_register():
        agent.on_os_signal(signal.SIGTERM)  # would raise Interrupted into this call if it cut it short
        return FakeResponse(200, {"worker_id": "w_1", "heartbeat_interval": 30})

    session.script += [signalled_mid_register, FakeResponse(200, {"status": "offline"})]
    agent.tick()
    assert agent.registered
    pump(agent)
    assert session.calls[-1]["url"].endswith("/api/workers/disconnect")
    assert session.calls[-1]["json"] == {"worker_id": "w_1"} and session.calls[-1]["timeout"] == STOPPING_TIMEOUT
    assert agent.exit_code == 0


def test_which_signals_break_a_blocked_call():
    def interrupts(job_running, signals):
        agent = registered()
        if job_running:
            submit(agent)
        broken = []
        agent.client.interrupt = lambda force=False: broken.append((agent.signals_caught, force))
        for _ in range(signals):
            agent.on_os_signal(signal.SIGTERM)
        return broken

    # start the goodbye; let it finish; exit now (the third breaks even a registration)
    assert interrupts(False, 3) == [(1, False), (3, True)]
    assert interrupts(True, 3) == [(2, False), (3, True)]  # let the trainer finish; stop it now; exit now


def test_the_agent_follows_the_workers_type_and_says_when_its_name_differs(caplog):
    agent = make_agent(persistent=False)
    agent.client.script("register", {"worker_id": "w_1", "status": "idle", "worker_type": "persistent", "name": "gpu-one"})
    with caplog.at_level("WARNING"):
        agent.tick()
    assert agent.registered and agent.config.persistent is True
    assert (
        "This worker's type is persistent, set by the operator who created it, and it wins over starting without "
        "--persistent: this agent stays online between jobs. For an agent that exits after one job, start it with the "
        'token of an ephemeral worker (admin → Workers → Add worker, or POST /api/admin/workers with "worker_type": '
        '"ephemeral")'
    ) in caplog.text
    assert "The orchestrator knows this worker as 'gpu-one', not 'gpu-1'" in caplog.text


def test_an_agent_agreeing_with_its_worker_says_nothing(caplog):
    agent = make_agent(persistent=True)
    agent.client.script("register", {"worker_id": "w_1", "status": "idle", "worker_type": "persistent", "name": "gpu-1"})
    with caplog.at_level("WARNING"):
        agent.tick()
    assert agent.config.persistent is True and "orchestrator knows" not in caplog.text and "set by the operator" not in caplog.text


# --- agents of several workers sharing one work dir -------------------------------------------------


def _agent_of(worker_id, token):
    client = FakeClient()
    client.script("register", {"worker_id": worker_id, "status": "idle", "heartbeat_interval": 30})
    return make_agent(client=client, token=token)


def _finish_undelivered(agent, job_id):
    """Run ``job_id`` on ``agent`` to its end with the orchestrator unreachable: its result stays journaled."""
    run = submit(agent, job_id=job_id)
    agent.client.script("report:completed", TransientError("cannot reach the orchestrator: connection refused"))
    run.exit(0)
    pump(agent)
    assert agent.pending_report is not None


def test_an_agent_reports_only_its_own_workers_results_from_a_shared_work_dir():
    first = _agent_of("w_a", "wt_a")
    first.tick()
    _finish_undelivered(first, "j_a")
    kept = WORK_DIR / "w_a" / "j_a" / "outcome.json"
    assert json.loads(kept.read_text())["worker_id"] == "w_a"
    # the first agent dies; an agent of another worker starts in the same work dir
    second = _agent_of("w_b", "wt_b")
    assert second.journaled == []
    run_until(second, lambda: second.registered)
    assert second.client.reports() == [] and kept.exists()
    assert (WORK_DIR / "w_b" / "worker.json").exists()
    # the first worker's agent comes back: it knows its worker by its token and reports before registering
    again = _agent_of("w_a", "wt_a")
    assert [(entry.job_id, legacy) for entry, legacy in again.journaled] == [("j_a", False)]
    again.tick()
    assert again.client.names() == ["report", "register"]
    assert again.client.reports()[0][:2] == ("j_a", "completed") and not kept.exists()


def test_a_legacy_result_refused_as_another_workers_is_left_in_place_for_its_owner():
    from worker_agent import journal

    legacy = journal.write_outcome(WORK_DIR / "j_old", "j_old", {"status": "completed", "attempt": "a_1"})  # no worker id
    other = _agent_of("w_b", "wt_b")
    other.client.script("report:completed", refused("j_old"))
    other.tick()
    assert other.registered and legacy.exists()  # not its job: untouched, not marked reported
    assert other.finished_attempts == []  # nor taken for an attempt of its own
    owner = _agent_of("w_a", "wt_a")
    owner.tick()
    assert owner.client.reports()[0][:2] == ("j_old", "completed")
    assert not legacy.exists() and legacy.with_name("outcome.reported.json").exists()


def test_a_rotated_token_finds_its_workers_results_once_registered():
    first = _agent_of("w_a", "wt_old")
    first.tick()
    _finish_undelivered(first, "j_a")
    kept = WORK_DIR / "w_a" / "j_a" / "outcome.json"
    rotated = _agent_of("w_a", "wt_new")
    assert rotated.journaled == []  # the new token is not known here yet
    rotated.tick()
    assert rotated.client.names() == ["register", "report"]
    assert rotated.client.reports()[0][:2] == ("j_a", "completed") and not kept.exists()
