"""Several jobs at once on one worker (issue 30): each on its own GPUs, each with its own acknowledgement, result,
journal, cancel and abandon; heartbeats, re-registration, drain and signals over all of them. Driven message by
message with the fake orchestrator, clock, monitor and job of test_agent.py."""

import json
import logging
import signal
import socket
from pathlib import Path

import pytest

from worker_agent import journal, protocol
from worker_agent.jobs import port_free
from worker_agent.client import TransientError
from worker_agent.runner import STOP_ABANDON, STOP_AGENT_EXIT, STOP_CANCEL
from worker_agent.sse import Event

from . import test_agent as base
from .fakes import FakeClient, FakeMonitor, FakeRun, refused
from .test_agent import pump, work_dir  # noqa: F401 - work_dir: the autouse fixture of each test's dir

ANSWER = {"worker_id": "w_1", "status": "idle", "heartbeat_interval": 30}
ABSENT = object()


def make_agent(*, slots=(0, 1, 2, 3), declared=True, max_jobs=4, client=None, **kwargs):
    """A started agent over ``slots`` whose registration is answered with ``max_jobs`` (ABSENT: not said)."""
    client = client or FakeClient()
    if "register" not in client.answers:
        client.script("register", ANSWER if max_jobs is ABSENT else {**ANSWER, "max_jobs": max_jobs})
    return base.make_agent(client=client, monitor=FakeMonitor(slots, declared), **kwargs)


def registered(**kwargs):
    agent = make_agent(**kwargs)
    agent.tick()
    assert agent.registered
    return agent


def submit(agent, job_id, attempt, gpus=None, **extra):
    """Send a job_submit; return the FakeRun it started, or None."""
    payload = {"type": "job_submit", "job_id": job_id, "attempt": attempt, "config": {"x": 1}, "dataloader": None,
               "upload_endpoint": f"/api/workers/job/{job_id}/status", **extra}  # fmt: skip
    if gpus is not None:
        payload["gpu_indices"] = gpus
    agent.on_event(Event("job_submit", json.dumps(payload), "worker-w_1:1"))
    return run_of(job_id)


def run_of(job_id):
    return next((run for run in reversed(FakeRun.instances) if run.job_id == job_id), None)


def statuses(agent, job_id):
    return [status for _, status, _ in agent.client.reports(job_id)]


def heartbeats(agent):
    return [call[1] for call in agent.client.calls if call[0] == "heartbeat"]


def outcome(job_id, name=journal.OUTCOME_FILE):
    return Path(base.WORK_DIR) / "w_1" / job_id / name


# --- registration -----------------------------------------------------------------------------------


def test_registers_declared_slots_with_max_jobs_running_jobs_and_the_advertised_address():
    agent = registered(gpus=[0, 1, 2, 3], advertise_address="10.0.0.7")
    assert agent.monitor.used == [0, 1, 2, 3]  # --gpus reached the monitor before it was asked anything
    body = agent.client.calls[0][1]
    assert body["gpu_slots"] == [0, 1, 2, 3] and body["gpu_slots_declared"] is True
    assert body["max_jobs"] == 4 and body["running_jobs"] == [] and body["advertise_address"] == "10.0.0.7"
    assert agent.max_jobs == 4
    assert body["multi_node"] is True  # it runs a member of a multi-node job (runner.placement_env)


def test_nvml_gpus_are_not_declared_and_one_slot_offers_no_max_jobs():
    body = registered(slots=[0, 1], declared=False).client.calls[0][1]
    assert body["gpu_slots"] == [0, 1] and "gpu_slots_declared" not in body and body["max_jobs"] == 2
    single = registered(slots=[0], declared=False, max_jobs=ABSENT)
    body = single.client.calls[0][1]
    assert body["gpu_slots"] == [0] and "max_jobs" not in body and "running_jobs" not in body
    assert "advertise_address" not in body and single.max_jobs == 1


def test_more_slots_than_a_worker_may_run_jobs_offer_the_most_it_may():
    body = registered(slots=list(range(protocol.MAX_JOBS_MAX + 8))).client.calls[0][1]
    assert body["max_jobs"] == protocol.MAX_JOBS_MAX == 64  # the orchestrator refuses more (400)


def test_gpus_nvml_does_not_see_are_a_one_line_startup_error(caplog):
    class Refusing(FakeMonitor):
        def use_gpus(self, indices):
            raise ValueError("--gpus names GPU 7, which NVML does not see (it sees 0, 1)")

    with caplog.at_level(logging.ERROR):
        agent = base.make_agent(monitor=Refusing(), gpus=[0, 7])
    assert agent.exit_code == 1 and agent.client.calls == []  # never registers
    errors = [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR]
    assert len(errors) == 1 and "\n" not in errors[0] and "GPU 7, which NVML does not see" in errors[0]


def test_running_jobs_names_every_job_held_on_re_registering():
    agent = registered()
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    second.exit(0)
    agent.client.script("report:completed", TransientError("down"))
    pump(agent)  # j_2's result is held, not delivered
    agent.client.script("report:completed", {"accepted": True})
    agent.client.script("register", {**ANSWER, "max_jobs": 4, "resume_jobs": [{"job_id": "j_1", "attempt": "a_1"}]})
    agent.handle(("stream_lost", "connection lost", 60.0))
    agent.tick()
    assert agent.client.names().count("register") == 1  # waits for j_2's result first
    agent.clock.now = agent.report_due
    agent.tick()
    body = [call[1] for call in agent.client.calls if call[0] == "register"][-1]
    assert body["running_jobs"] == [{"job_id": "j_1", "attempt": "a_1"}]  # j_2's result went first
    assert body["current_job_id"] == "j_1" and body["current_attempt"] == "a_1"
    assert statuses(agent, "j_2")[-1] == "completed" and agent.client.reports("j_2")[-1][2]["attempt"] == "a_2"
    assert first.running and first.stop_reason is None


# --- one job at a time unless the orchestrator says otherwise ---------------------------------------


@pytest.mark.parametrize("max_jobs", [ABSENT, 1, None], ids=["absent", "one", "null"])
def test_one_job_at_a_time_when_the_register_answer_does_not_say_max_jobs_above_one(max_jobs):
    agent = registered(max_jobs=max_jobs)
    assert agent.max_jobs == 1
    first = submit(agent, "j_1", "a_1")
    assert submit(agent, "j_2", "a_2") is None  # waits, as today
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    assert "jobs" not in heartbeats(agent)[-1]
    first.exit(0)
    pump(agent)
    assert run_of("j_2").running and statuses(agent, "j_1")[-1] == "completed"


def test_the_answers_max_jobs_is_capped_at_the_slots_offered():
    assert registered(slots=[0, 1], max_jobs=8).max_jobs == 2


# --- several jobs at once -----------------------------------------------------------------------


@pytest.mark.parametrize("count", [2, 4])
def test_jobs_run_at_once_each_on_its_own_gpus(count):
    agent = registered()
    runs = [submit(agent, f"j_{index}", f"a_{index}", [index]) for index in range(count)]
    assert all(run is not None and run.running for run in runs)
    for index, run in enumerate(runs):
        assert run.placement == {"gpu_indices": [index]}
        assert statuses(agent, f"j_{index}") == ["starting", "running"]
    assert agent.waiting == []


def test_a_job_given_the_whole_worker_sees_only_the_gpus_chosen_by_gpus():
    """--gpus 2,3 on a node whose NVML sees more: a job dispatched without gpu_indices (the whole worker) runs on
    GPUs 2 and 3 alone; its config is left as it is. Declared slots (no NVIDIA GPU) and no --gpus change nothing."""
    from worker_agent.runner import WORKER_GPUS

    restricted = registered(slots=(2, 3), declared=False, max_jobs=2, gpus=[2, 3])
    assert submit(restricted, "j_whole", "a_w").placement == {WORKER_GPUS: [2, 3]}
    assert submit(registered(slots=(0, 1, 2, 3), declared=False), "j_all", "a_a").placement is None  # no --gpus
    assert submit(registered(gpus=[0, 1, 2, 3]), "j_declared", "a_d").placement is None
    placed = registered(slots=(2, 3), declared=False, max_jobs=2, gpus=[2, 3])
    assert submit(placed, "j_one", "a_1", [3]).placement == {"gpu_indices": [3]}


def test_a_two_gpu_job_and_two_one_gpu_jobs_share_four_gpus():
    agent = registered()
    wide = submit(agent, "j_wide", "a_w", [0, 1])
    one, two = submit(agent, "j_one", "a_1", [2]), submit(agent, "j_two", "a_2", [3])
    assert wide.running and one.running and two.running
    assert wide.placement == {"gpu_indices": [0, 1]}


def test_a_multi_node_member_gets_its_rendezvous():
    agent = registered()
    gang = {"num_nodes": 2, "node_rank": 1, "master_addr": "10.0.0.5", "master_port": 29511}
    run = submit(agent, "j_gang", "a_g", [0, 1], **gang)
    assert run.running and run.placement == {"gpu_indices": [0, 1], **gang}


def test_rank_0_is_not_started_on_a_master_port_something_listens_on():
    agent = registered()
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        gang = {"num_nodes": 2, "node_rank": 0, "master_addr": "127.0.0.1", "master_port": port}
        assert submit(agent, "j_gang", "a_g", [0], **gang) is None
        [(_, status, body)] = agent.client.reports("j_gang")
        assert status == "failed" and f"master_port {port} is in use on this worker" in body["error"]
        assert submit(agent, "j_rank1", "a_r", [1], **{**gang, "node_rank": 1}).running  # only rank 0 listens there
    assert port_free(port)
    run = submit(agent, "j_gang2", "a_g2", [2], **gang)  # free now: rank 0 starts, and nothing holds the port
    assert run.running and port_free(port)


@pytest.mark.parametrize(
    "gpus,extra,error",
    [
        ([1], {}, "GPU 1 is in use by job j_1"),
        ([0, 5], {}, "GPU 5 is not one of this worker's GPUs (0,1,2,3)"),
        (None, {}, "it asks for the whole worker while job j_1 runs on it"),
        ([2, 2], {}, "gpu_indices must be a list of distinct GPU indices"),
        ([2], {"num_nodes": 2, "node_rank": 1, "master_port": 29500}, "a 2-node job needs master_addr"),
        ([2], {"num_nodes": 2, "node_rank": 2, "master_addr": "h", "master_port": 1}, "node_rank must be a whole number from 0 to 1"),
    ],
)
def test_a_dispatch_that_cannot_run_here_is_reported_failed_and_not_started(gpus, extra, error):
    agent = registered()
    first = submit(agent, "j_1", "a_1", [0, 1])
    assert submit(agent, "j_2", "a_2", gpus, **extra) is None
    [(_, status, body)] = agent.client.reports("j_2")  # no `starting`: not acknowledged, never run
    assert status == "failed" and body["attempt"] == "a_2" and set(body) == {"status", "attempt", "error"}
    assert body["error"].startswith("not started on this worker: ") and error in body["error"]
    assert not outcome("j_2").exists() and "j_2" not in agent.slots  # nothing ran: nothing journaled, nothing held
    assert first.running
    assert submit(agent, "j_2", "a_2", [2]) is None  # the same dispatch replayed: its attempt is over


def test_gpus_freed_by_a_finished_job_can_be_given_again():
    agent = registered()
    first = submit(agent, "j_1", "a_1", [0])
    first.exit(0)
    pump(agent)
    again = submit(agent, "j_2", "a_2", [0])
    assert again.running and statuses(agent, "j_2") == ["starting", "running"]


# --- per job: acknowledgement, result and journal, cancel, 409 -------------------------------------


def test_each_dispatch_is_acknowledged_on_its_own():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"), {"accepted": True})
    assert submit(agent, "j_1", "a_1", [0]) is None  # not acknowledged: not started
    second = submit(agent, "j_2", "a_2", [1])
    assert second.running and agent.slots["j_1"].ack is not None
    agent.clock.now = agent.slots["j_1"].ack.due
    agent.tick()
    assert run_of("j_1").running and statuses(agent, "j_1") == ["starting", "starting", "running"]


def test_a_dispatch_given_up_frees_only_its_own_gpus():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"), {"accepted": True})
    assert submit(agent, "j_1", "a_1", [0]) is None
    agent.client.script("report:starting", {"accepted": True})
    second = submit(agent, "j_2", "a_2", [1])
    agent.client.script("report:starting", TransientError("HTTP 503"))
    agent.clock.now += 61
    agent.tick()
    assert "j_1" not in agent.slots and run_of("j_1") is None and second.running
    assert agent.register_due == agent.clock.now  # says so at once: a registration without them


def test_results_are_journaled_and_delivered_per_job():
    agent = registered()
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    agent.client.script("report:failed", TransientError("HTTP 503"), {"accepted": True})
    first.exit(1)
    second.exit(0)
    pump(agent)
    assert statuses(agent, "j_2")[-1] == "completed" and outcome("j_2", journal.REPORTED_FILE).exists()
    assert outcome("j_1").exists() and agent.slots["j_1"].report["status"] == "failed"  # held, retried
    assert agent.client.reports("j_2")[-1][2]["attempt"] == "a_2"
    agent.clock.now = agent.slots["j_1"].report_due
    agent.tick()
    assert statuses(agent, "j_1")[-1] == "failed" and outcome("j_1", journal.REPORTED_FILE).exists()
    assert agent.slots == {}


def test_cancel_stops_only_its_job():
    agent = registered()
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    agent.on_event(Event("job_cancel", '{"type": "job_cancel", "job_id": "j_2", "attempt": "a_2"}'))
    assert second.stop_reason == STOP_CANCEL and first.stop_reason is None
    second.exit(-15)
    pump(agent)
    assert statuses(agent, "j_2")[-1] == "cancelled" and first.running and list(agent.slots) == ["j_1"]


@pytest.mark.parametrize("gpus", [[0], None])
def test_a_dispatch_onto_gpus_a_trainer_being_stopped_holds_waits_for_it_instead_of_failing(gpus):
    """The orchestrator frees a job's GPUs once it decides the job is over here (an attempt superseded by an earlier
    one's completion), before the trainer has stopped: the next job placed there waits, then starts (the chaos soak
    saw it reported failed, 'GPU 0 is in use by job ...', at its first attempt)."""
    agent = registered()
    first, other = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_other", "a_o", [1])
    agent.on_event(Event("job_cancel", '{"type": "job_cancel", "job_id": "j_1", "attempt": "a_1"}'))
    assert first.stop_reason == STOP_CANCEL and first.running
    if gpus is None:  # the whole worker: it waits for the stopping trainer, and is refused beside a running one
        other.exit(0)
        pump(agent)
    assert submit(agent, "j_2", "a_2", gpus) is None
    assert statuses(agent, "j_2") == [] and [w["job_id"] for w in agent.waiting] == ["j_2"]
    first.exit(-15)
    pump(agent)
    second = run_of("j_2")
    assert second is not None and second.running and statuses(agent, "j_2") == ["starting", "running"]
    assert agent.waiting == []


def test_a_dispatch_onto_gpus_a_job_runs_on_is_still_refused():
    agent = registered()
    submit(agent, "j_1", "a_1", [0])
    assert submit(agent, "j_2", "a_2", [0]) is None
    assert statuses(agent, "j_2") == ["failed"] and agent.waiting == []


def test_a_409_on_one_jobs_report_abandons_only_that_job():
    agent = registered()
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    agent.client.report = _refusing(agent.client, "j_2")
    second.emit("line", step=1)
    first.emit("line", step=1)
    agent.clock.now += 2
    agent.tick()
    assert second.stop_reason == STOP_ABANDON and first.stop_reason is None
    second.exit(-15)
    pump(agent)
    assert statuses(agent, "j_2")[-1] == "running"  # abandoned: never reported
    assert list(agent.slots) == ["j_1"] and first.running


def _refusing(client, job_id):
    """``client.report`` refusing every report about ``job_id`` with 409 job_not_owned."""
    report = client.report

    def refusing(about, body):
        if about == job_id:
            client.calls.append(("report", about, dict(body)))
            raise refused(about)
        return report(about, body)

    return refusing


# --- restart: every journaled result is reported before registering -------------------------------


def test_restart_reports_two_journaled_results_before_registering():
    first_life = registered()
    one, two = submit(first_life, "j_1", "a_1", [0]), submit(first_life, "j_2", "a_2", [1])
    first_life.client.script("report:completed", TransientError("down"))
    one.exit(0)
    two.exit(0)
    pump(first_life)  # both journaled, neither delivered; the agent dies here (kill -9)
    assert outcome("j_1").exists() and outcome("j_2").exists()
    agent = make_agent()
    agent.tick()
    names = [(call[0], call[1] if call[0] == "report" else None) for call in agent.client.calls]
    assert names == [("report", "j_1"), ("report", "j_2"), ("register", None)]
    assert all(body["journal"] is True and body["status"] == "completed" for _, _, body in agent.client.reports())
    assert agent.client.calls[-1][1]["running_jobs"] == []
    assert outcome("j_1", journal.REPORTED_FILE).exists() and outcome("j_2", journal.REPORTED_FILE).exists()


def test_re_registering_resumes_and_abandons_each_job():
    agent = registered()
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    agent.client.script("report:starting", TransientError("HTTP 503"))
    assert submit(agent, "j_3", "a_3", [2]) is None
    agent.client.script(
        "register",
        {**ANSWER, "max_jobs": 4, "resume_jobs": [{"job_id": "j_1", "attempt": "a_1"}, {"job_id": "j_3", "attempt": "a_3"}],
         "abandon_jobs": ["j_2"]},
    )  # fmt: skip
    agent.handle(("stream_lost", "connection lost", 60.0))
    agent.tick()
    body = [call[1] for call in agent.client.calls if call[0] == "register"][-1]
    assert body["running_jobs"] == [{"job_id": j, "attempt": a} for j, a in (("j_1", "a_1"), ("j_2", "a_2"), ("j_3", "a_3"))]
    assert first.stop_reason is None and second.stop_reason == STOP_ABANDON
    assert run_of("j_3").running  # resume_jobs naming its attempt acknowledged the dispatch


# --- heartbeats --------------------------------------------------------------------------------


def test_heartbeat_carries_every_job_with_its_attempt_progress_and_log():
    agent = registered()
    first = submit(agent, "j_1", "a_1", [0])
    agent.client.script("report:starting", TransientError("HTTP 503"))
    assert submit(agent, "j_2", "a_2", [1]) is None
    first.emit("epoch 1", step=3)
    agent.client.script("heartbeat", {"status": "busy", "draining": False, "current_job_id": "j_1", "current_attempt": "a_1",
                                      "jobs": [{"job_id": "j_1", "attempt": "a_1"}, {"job_id": "j_2", "attempt": "a_2"}]})  # fmt: skip
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    body = heartbeats(agent)[-1]
    assert body["status"] == "busy" and body["current_job_id"] == "j_1" and body["attempt"] == "a_1"
    assert body["jobs"] == [
        {"job_id": "j_1", "attempt": "a_1", "progress": {"step": 3}, "log_tail": "epoch 1"},
        {"job_id": "j_2", "attempt": "a_2"},
    ]
    assert run_of("j_2").running  # the answer holding j_2 under a_2 acknowledged its dispatch


def test_a_job_the_heartbeat_answer_no_longer_holds_is_abandoned():
    agent = registered()
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    agent.client.script("heartbeat", {"status": "busy", "draining": False, "current_job_id": "j_1", "current_attempt": "a_1",
                                      "jobs": [{"job_id": "j_1", "attempt": "a_1"}]})  # fmt: skip
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    assert second.stop_reason == STOP_ABANDON and first.stop_reason is None


def test_an_idle_multi_job_heartbeat_says_idle_with_no_jobs():
    agent = registered()
    agent.clock.now = agent.next_heartbeat
    agent.tick()
    body = heartbeats(agent)[-1]
    assert body["status"] == "idle" and body["jobs"] == [] and body["current_job_id"] is None


# --- drain and signals over every job ---------------------------------------------------------------


def finish_one_then_the_other(agent, first, second):
    """Complete ``first``: the agent stays for ``second``; then complete it: both are reported."""
    first.exit(0)
    pump(agent)
    assert agent.exit_code is None and "disconnect" not in agent.client.names() and second.running
    second.exit(0)
    pump(agent)
    assert statuses(agent, first.job_id)[-1] == statuses(agent, second.job_id)[-1] == "completed"


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "ephemeral"])
def test_drain_finishes_every_job_then_takes_none(persistent):
    agent = registered(persistent=persistent)
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    agent.on_event(Event("drain", json.dumps({"type": "drain", "current_job_id": "j_1", "job_ids": ["j_1", "j_2"]})))
    assert agent.draining and first.stop_reason is None and second.stop_reason is None
    finish_one_then_the_other(agent, first, second)
    if persistent:
        assert agent.exit_code is None and "disconnect" not in agent.client.names()
    else:
        assert agent.exit_code == 0 and agent.client.names()[-1] == "disconnect"


def test_an_ephemeral_agent_leaves_once_its_last_job_is_reported():
    agent = registered(persistent=False)
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    finish_one_then_the_other(agent, first, second)
    assert agent.exit_code == 0 and agent.client.names()[-1] == "disconnect"


def test_first_signal_lets_every_job_finish_then_leaves():
    agent = registered()
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    agent.client.script("report:starting", TransientError("HTTP 503"))
    assert submit(agent, "j_3", "a_3", [2]) is None
    agent.handle(("signal", signal.SIGTERM))
    assert first.stop_reason is None and second.stop_reason is None
    assert "j_3" not in agent.slots and run_of("j_3") is None  # its dispatch was not acknowledged: not started
    assert submit(agent, "j_4", "a_4", [3]) is None  # no new job while stopping
    finish_one_then_the_other(agent, first, second)
    assert agent.exit_code == 0 and agent.client.names()[-1] == "disconnect"


def test_second_signal_stops_every_job_and_leaves_once_all_stopped():
    agent = registered()
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    agent.handle(("signal", signal.SIGTERM))
    agent.handle(("signal", signal.SIGTERM))
    assert first.stop_reason == second.stop_reason == STOP_AGENT_EXIT
    first.exit(-15)
    pump(agent)
    assert agent.exit_code is None
    second.exit(-15)
    pump(agent)
    assert agent.exit_code == 0 and agent.client.names()[-1] == "disconnect"
    assert statuses(agent, "j_1") == statuses(agent, "j_2") == ["starting", "running"]  # handed back, not reported


def test_third_signal_kills_every_job_and_exits():
    agent = registered()
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    for _ in range(3):
        agent.handle(("signal", signal.SIGTERM))
    assert first.killed and second.killed and agent.exit_code == 1


def test_a_signal_waits_for_running_jobs_before_exiting_with_an_undelivered_result():
    agent = registered()
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    agent.client.script("report:completed", TransientError("down"))
    second.exit(0)
    pump(agent)
    agent.handle(("signal", signal.SIGTERM))
    assert agent.exit_code is None and first.stop_reason is None  # j_1 still runs: j_2's result is retried later
    first.exit(0)
    pump(agent)
    assert agent.exit_code == 0 and "disconnect" not in agent.client.names()  # both results kept in the journal
    assert outcome("j_1").exists() and outcome("j_2").exists()


def test_a_job_cancelled_before_it_started_frees_its_gpus_for_the_next():
    agent = registered()
    agent.client.script("report:starting", TransientError("HTTP 503"))
    assert submit(agent, "j_1", "a_1", [0]) is None
    agent.on_event(Event("job_cancel", '{"type": "job_cancel", "job_id": "j_1", "attempt": "a_1"}'))
    assert statuses(agent, "j_1")[-1] == protocol.CANCELLED and "j_1" not in agent.slots
    agent.client.script("report:starting", {"accepted": True})
    assert submit(agent, "j_2", "a_2", [0]).running


def test_a_fatal_exit_stops_every_running_trainer():
    agent = registered()
    first, second = submit(agent, "j_1", "a_1", [0]), submit(agent, "j_2", "a_2", [1])
    agent._shut_down()
    assert first.stop_reason == second.stop_reason == STOP_AGENT_EXIT
    assert first.signals == second.signals == ["TERM"]
