"""The soak's audit rules and chaos plan, on hand-made rows: each finding the soak can report, and a clean run."""

import random

from .audit import audit, parse_ledger
from .soak import AGENT_KILL9, AGENT_SIGTERM, ORCHESTRATOR_KILL9, chaos_plan

WORKERS_IDLE = {"w_1": {"name": "gpu-1", "status": "idle", "current_job_id": None}}


def job(status, *, last_error="", worker_id=None):
    return {"status": status, "last_error": last_error, "worker_id": worker_id}


def line(job_id, attempt):
    return {"job_id": job_id, "attempt": attempt, "pid": 1, "time": 0.0}


def run(jobs, *, ledger=(), completed=None, workers=None, submitted=None, **kwargs):
    return audit(
        submitted_ids=list(jobs) if submitted is None else submitted,
        jobs=jobs,
        workers=WORKERS_IDLE if workers is None else workers,
        completed_attempts=completed or {},
        ledger=list(ledger),
        **kwargs,
    )


def test_a_clean_run_passes():
    result = run(
        {"j_a": job("completed"), "j_b": job("failed", last_error="worker lost: retries exhausted")},
        ledger=[line("j_a", "a_1")],
        completed={"j_a": ["a_1"]},
    )
    assert result.passed
    assert (result.lost, result.twice, result.inconsistent) == ([], [], [])
    assert result.by_status == {"completed": 1, "failed": 1}


def test_two_ledger_lines_are_completed_twice_and_inconsistent():
    result = run({"j_a": job("completed")}, ledger=[line("j_a", "a_1"), line("j_a", "a_2")], completed={"j_a": ["a_2"]})
    assert result.twice == [("j_a", 2)]
    assert result.inconsistent == [("j_a", "completed with 2 ledger lines")]
    assert not result.passed


def test_a_completed_job_needs_its_one_ledger_line_from_the_completed_attempt():
    missing = run({"j_a": job("completed")}, completed={"j_a": ["a_1"]})
    assert missing.inconsistent == [("j_a", "completed with 0 ledger lines")]
    other = run({"j_a": job("completed")}, ledger=[line("j_a", "a_1")], completed={"j_a": ["a_2"]})
    assert other.inconsistent == [("j_a", "the trainer that completed ran attempt a_1, the database completed a_2")]
    no_attempt = run({"j_a": job("completed")}, ledger=[line("j_a", "a_1")])
    assert no_attempt.inconsistent == [("j_a", "completed with 0 completed attempts")]


def test_jobs_that_did_not_finish_or_failed_without_a_reason_are_lost():
    jobs = {
        "j_q": job("queued"),
        "j_c": job("cancelled"),
        "j_f": job("failed", last_error="  "),
        "j_r": job("running", worker_id="w_1"),
    }
    workers = {"w_1": {"name": "gpu-1", "status": "busy", "current_job_id": "j_r"}}
    result = run(jobs, workers=workers, submitted=[*jobs, "j_gone"])
    assert sorted(result.lost) == [
        ("j_c", "cancelled at the end"),
        ("j_f", "failed without a reason"),
        ("j_gone", "not in the database"),
        ("j_q", "queued at the end"),
        ("j_r", "running at the end"),
    ]
    assert result.inconsistent == [("j_r", "left running after the drain")]


def test_a_trainer_that_completed_for_a_job_not_completed_is_inconsistent():
    result = run({"j_a": job("failed", last_error="worker lost")}, ledger=[line("j_a", "a_1")])
    assert result.lost == []
    assert result.inconsistent == [("j_a", "failed although 1 trainer run(s) of it completed")]


def test_workers_and_active_jobs_must_point_at_each_other():
    jobs = {"j_a": job("dispatched"), "j_b": job("running", worker_id="w_2"), "j_done": job("failed", last_error="x")}
    workers = {
        "w_1": {"name": "gpu-1", "status": "busy", "current_job_id": None},
        "w_2": {"name": "gpu-2", "status": "idle", "current_job_id": None},
        "w_3": {"name": "gpu-3", "status": "idle", "current_job_id": "j_done"},
    }
    result = run(jobs, workers=workers)
    assert set(result.inconsistent) == {
        ("j_a", "left dispatched after the drain"),
        ("j_a", "dispatched with no worker"),
        ("j_b", "left running after the drain"),
        ("j_b", "running on gpu-2, whose current job is None"),
        ("w_1", "worker gpu-1 busy without a current job"),
        ("w_3", "worker gpu-3 holds job j_done, which is failed"),
    }


def test_stray_trainers_unknown_jobs_and_torn_lines_are_inconsistent():
    records, bad = parse_ledger('{"job_id": "j_x", "attempt": "a_9"}\n{"job_id": "j_a", "att\n\n')
    assert (records, bad) == ([{"job_id": "j_x", "attempt": "a_9"}], ['{"job_id": "j_a", "att'])
    result = run({}, ledger=records, bad_ledger_lines=bad, stray_trainers=["pid 7 in /tmp/j_a"])
    assert [subject for subject, _ in result.inconsistent] == ["j_x", "ledger", "trainer"]
    assert result.ledger_lines == 2


def test_the_chaos_plan_comes_from_the_seed_alone():
    def plan(seed):
        return chaos_plan(random.Random(seed), duration=60, slots=4, orchestrator_kills=3, mean_gap=3.0)

    assert plan(7) == plan(7)
    assert plan(7) != plan(8)
    actions = plan(7)
    assert [a.at for a in actions] == sorted(a.at for a in actions)
    assert sum(a.kind == ORCHESTRATOR_KILL9 for a in actions) == 3
    assert {a.kind for a in actions} == {AGENT_KILL9, AGENT_SIGTERM, ORCHESTRATOR_KILL9}
    assert all(0 < a.at < 60 for a in actions)
    assert all(1 <= a.delay <= 10 for a in actions if a.kind == AGENT_KILL9)
    assert all(1 <= a.delay <= 3 for a in actions if a.kind == ORCHESTRATOR_KILL9)
    for outage in (a for a in actions if a.kind == ORCHESTRATOR_KILL9):  # an agent dies while it is down or just back
        assert any(a.kind == AGENT_KILL9 and outage.at <= a.at <= outage.at + outage.delay + 2 for a in actions)
