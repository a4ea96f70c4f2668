"""The soak's audit rules and chaos plan, on hand-made rows: each finding the soak can report, and a clean run."""

import random

from .audit import audit, gpu_overlaps, parse_ledger, placement_findings, trainer_runs
from .soak import AGENT_KILL9, AGENT_SIGTERM, ORCHESTRATOR_KILL9, chaos_plan, most_at_once

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


def test_a_late_duplicate_is_counted_apart_when_the_other_attempt_was_taken_back_without_its_workers_word():
    """C, by design: attempt a_1 completed while its agent was down; the orchestrator declared it lost, a_2
    completed the job, and a_1's result, arriving late, was refused. Each attempt ran once: not completed twice."""
    ledger = [line("j_a", "a_1"), line("j_a", "a_2")]
    for taken_back in ("lost", "unacknowledged", "interrupted", "superseded"):
        result = run({"j_a": job("completed")}, ledger=ledger, completed={"j_a": ["a_2"]},
                     attempt_outcomes={"a_1": taken_back, "a_2": "completed"})
        assert (result.twice, result.inconsistent) == ([], []), taken_back
        assert result.late_duplicates == [("j_a", f"completed by a_2; also ran to the end: a_1 ({taken_back})")]
        assert result.passed


def test_two_results_accepted_or_one_attempt_run_twice_are_never_a_late_duplicate():
    two = [line("j_a", "a_1"), line("j_a", "a_2")]
    cases = [
        (two, {"j_a": ["a_1", "a_2"]}, {"a_1": "completed", "a_2": "completed"}),  # both accepted
        (two, {"j_a": ["a_2"]}, {"a_1": "failed", "a_2": "completed"}),  # a_1 ended by its worker's word
        ([line("j_a", "a_2"), line("j_a", "a_2")], {"j_a": ["a_2"]}, {"a_2": "completed"}),  # one attempt twice
        (two, {"j_a": ["a_3"]}, {"a_1": "lost", "a_2": "lost", "a_3": "completed"}),  # the kept result not among them
    ]
    for ledger, completed, outcomes in cases:
        result = run({"j_a": job("completed")}, ledger=ledger, completed=completed, attempt_outcomes=outcomes)
        assert result.twice == [("j_a", 2)] and result.late_duplicates == [] and not result.passed, (completed, outcomes)
    unknown = run({"j_a": job("completed")}, ledger=two, completed={"j_a": ["a_2"]})  # no outcomes given: strict
    assert unknown.twice == [("j_a", 2)]


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
    result = run({}, ledger=records, bad_ledger_lines=bad, stray_trainers=["pid 7 in /tmp/j_a"], bad_runs_lines=["{"])
    assert [subject for subject, _ in result.inconsistent] == ["j_x", "ledger", "runs", "trainer"]
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


# --- packing workers (max_jobs > 1): the jobs they hold are the jobs with holds_gpus on them ---------------


def packer(status="busy", *, gpus_free=0, slots=(0, 1, 2, 3), max_jobs=4):
    return {
        "name": "pack-1", "status": status, "current_job_id": None, "max_jobs": max_jobs,
        "gpu_slots": list(slots), "gpus_free": gpus_free,
    }  # fmt: skip


def placed(status, indices, *, gpu_count=None, holds=True, worker_id="w_p"):
    gpu_count = len(indices) if gpu_count is None else gpu_count
    return {
        "status": status, "last_error": "", "worker_id": worker_id, "gpu_count": gpu_count,
        "gpu_indices": list(indices), "holds_gpus": holds,
    }  # fmt: skip


def test_a_packing_worker_running_jobs_side_by_side_is_consistent():
    jobs = {"j_a": placed("running", [0, 1]), "j_b": placed("dispatched", [2]), "j_c": placed("completed", [3], holds=False)}
    assert placement_findings(jobs, {"w_p": packer(gpus_free=1)}) == []
    whole = {"j_w": placed("running", [0, 1, 2, 3], gpu_count=0)}  # needs 0: every slot, alone
    assert placement_findings(whole, {"w_p": packer(gpus_free=0)}) == []
    full = {f"j_{n}": placed("running", [n]) for n in range(2)}  # max_jobs 2 reached: no room, GPUs or not
    assert placement_findings(full, {"w_p": packer(gpus_free=0, max_jobs=2)}) == []
    assert placement_findings({}, {"w_p": packer("idle", gpus_free=4)}) == []


def test_an_active_job_on_a_packing_worker_must_be_among_the_jobs_it_holds():
    jobs = {"j_a": placed("running", [0], holds=False)}
    assert placement_findings(jobs, {"w_p": packer("idle", gpus_free=4)}) == [
        ("j_a", "running on packing worker pack-1, which does not hold it among its jobs")
    ]


def test_a_job_a_packing_worker_holds_must_be_active():
    jobs = {"j_a": placed("completed", [0])}
    assert placement_findings(jobs, {"w_p": packer(gpus_free=3)}) == [("w_p", "packing worker pack-1 holds job j_a, which is completed")]


def test_a_busy_packing_worker_holds_a_job():
    assert placement_findings({}, {"w_p": packer("busy", gpus_free=4)}) == [("w_p", "packing worker pack-1 busy holding no job")]


def test_a_packing_workers_free_gpus_are_its_slots_less_its_jobs_gpus():
    jobs = {"j_a": placed("running", [0, 1])}
    assert placement_findings(jobs, {"w_p": packer(gpus_free=3)}) == [
        ("w_p", "packing worker pack-1 says gpus_free 3; its 4 slots less its 1 jobs' GPUs leave 2")
    ]
    full = {f"j_{n}": placed("running", [n]) for n in range(2)}
    assert placement_findings(full, {"w_p": packer(gpus_free=2, max_jobs=2)}) == [
        ("w_p", "packing worker pack-1 says gpus_free 2; its 4 slots less its 2 jobs' GPUs leave 0")
    ]


def test_no_gpu_is_held_by_two_jobs_at_once():
    jobs = {"j_a": placed("running", [0, 1]), "j_b": placed("running", [1])}
    assert placement_findings(jobs, {"w_p": packer(gpus_free=2)}) == [
        ("w_p", "GPU 1 of packing worker pack-1 held by 2 jobs at once: j_a, j_b")
    ]


def test_a_held_job_has_as_many_of_the_workers_slots_as_it_needs():
    jobs = {"j_a": placed("running", [0], gpu_count=2), "j_b": placed("running", [7]), "j_w": placed("dispatched", [2], gpu_count=0)}
    assert placement_findings(jobs, {"w_p": packer(gpus_free=2)}) == [  # slots 1 and 3 are free
        ("j_a", "holds GPUs [0] of pack-1 (slots [0, 1, 2, 3]) but needs 2 of them"),
        ("j_b", "holds GPUs [7] of pack-1 (slots [0, 1, 2, 3]) but needs 1 of them"),
        ("j_w", "holds GPUs [2] of pack-1 (slots [0, 1, 2, 3]) but needs 4 of them"),
    ]


def test_placement_findings_of_the_final_state_and_of_the_snapshots_are_inconsistent():
    final = run({"j_a": job("completed", worker_id="w_p")}, ledger=[line("j_a", "a_1")], completed={"j_a": ["a_1"]},
                workers={"w_p": packer("busy", gpus_free=4)})  # fmt: skip
    assert final.inconsistent == [("w_p", "packing worker pack-1 busy holding no job")]
    during = run({}, snapshot_findings=[("w_p", "GPU 1 of packing worker pack-1 held by 2 jobs at once: j_a, j_b")])
    assert during.inconsistent == [("w_p", "GPU 1 of packing worker pack-1 held by 2 jobs at once: j_a, j_b")]


def test_a_trainer_sees_the_gpus_its_attempt_was_given():
    given = {"a_1": "0,1", "a_2": None}
    ok = [{**line("j_a", "a_1"), "cuda_visible_devices": "0,1"}, {**line("j_b", "a_2"), "cuda_visible_devices": None}]
    jobs = {"j_a": job("completed"), "j_b": job("completed")}
    completed = {"j_a": ["a_1"], "j_b": ["a_2"]}
    assert run(jobs, ledger=ok, completed=completed, attempt_gpus=given).passed
    wrong = [{**line("j_a", "a_1"), "cuda_visible_devices": "2"}, {**line("j_b", "a_2"), "cuda_visible_devices": "0"}]
    assert run(jobs, ledger=wrong, completed=completed, attempt_gpus=given).inconsistent == [
        ("j_a", "the trainer of attempt a_1 saw CUDA_VISIBLE_DEVICES=2; its attempt was given 0,1"),
        ("j_b", "the trainer of attempt a_2 saw CUDA_VISIBLE_DEVICES=0; its attempt was given None"),
    ]


def test_an_offline_packing_worker_holds_no_job_and_offers_no_gpu():
    assert placement_findings({}, {"w_p": packer("offline", gpus_free=0)}) == []
    jobs = {"j_a": placed("running", [0])}
    assert placement_findings(jobs, {"w_p": packer("offline", gpus_free=4)}) == [
        ("w_p", "packing worker pack-1 is offline and holds j_a"),
        ("w_p", "packing worker pack-1 is offline and says gpus_free 4, not 0"),
    ]


# --- trainers that ran at once on one worker (the runs file) ----------------------------------------------


def started(job_id, attempt, pid, at, worker_id="w_p", devices=None):
    return {
        "event": "start", "job_id": job_id, "attempt": attempt, "pid": pid, "time": at,
        "job_dir": f"/soak/agents/x/jobs/{worker_id}/{job_id}", "cuda_visible_devices": devices,
    }  # fmt: skip


def ended(job_id, attempt, pid, at):
    return {"event": "end", "job_id": job_id, "attempt": attempt, "pid": pid, "time": at, "how": "completed"}


def test_trainer_runs_pair_each_start_with_its_end():
    records = [started("j_a", "a_1", 10, 1.0, devices="0,1"), started("j_b", "a_2", 11, 2.0), ended("j_a", "a_1", 10, 3.0)]
    runs, open_runs = trainer_runs(records)
    assert runs == [{
        "job_id": "j_a", "attempt": "a_1", "worker_id": "w_p", "rank": None, "master_addr": None, "master_port": None,
        "gpus": [0, 1], "start": 1.0, "end": 3.0,
    }]  # fmt: skip
    assert [run["job_id"] for run in open_runs] == ["j_b"]


def test_trainers_side_by_side_on_their_own_gpus_or_one_after_another_are_fine():
    runs, _ = trainer_runs([
        started("j_a", "a_1", 10, 1.0, devices="0,1"), started("j_b", "a_2", 11, 1.5, devices="2"),
        ended("j_b", "a_2", 11, 2.0), ended("j_a", "a_1", 10, 3.0),
        started("j_w", "a_3", 12, 3.0), ended("j_w", "a_3", 12, 4.0),  # the whole worker, once both ended
        started("j_s", "a_4", 13, 1.0, worker_id="w_1"), ended("j_s", "a_4", 13, 2.0),
        started("j_t", "a_5", 14, 2.0, worker_id="w_1"), ended("j_t", "a_5", 14, 3.0),
    ])  # fmt: skip
    assert gpu_overlaps(runs, {"w_p": packer(), **WORKERS_IDLE}) == []


def test_two_trainers_on_one_gpu_of_a_packing_worker_at_once_are_inconsistent():
    runs, _ = trainer_runs([
        started("j_a", "a_1", 10, 1.0, devices="0,1"), started("j_b", "a_2", 11, 2.5, devices="1,2"),
        ended("j_a", "a_1", 10, 3.0), ended("j_b", "a_2", 11, 4.0),
        started("j_w", "a_3", 12, 3.75), ended("j_w", "a_3", 12, 5.0),  # the whole worker, while j_b ran
    ])  # fmt: skip
    found = gpu_overlaps(runs, {"w_p": packer()})
    assert [(subject, why.split(" used ")[1]) for subject, why in found] == [
        ("j_b", "GPU 1 for 0.500s beside the trainer of j_a (attempt a_1)"),
        ("j_w", "GPU 1,2 for 0.250s beside the trainer of j_b (attempt a_2)"),
    ]
    assert found[0][1].startswith("its trainer (attempt a_2) started on pack-1 at 00:00:02.500 and used")


def test_two_trainers_at_once_on_a_one_job_worker_are_inconsistent():
    runs, _ = trainer_runs([
        started("j_a", "a_1", 10, 1.0, worker_id="w_1"), started("j_a", "a_2", 11, 1.5, worker_id="w_1"),
        ended("j_a", "a_1", 10, 2.0), ended("j_a", "a_2", 11, 3.0),
    ])  # fmt: skip
    assert [why.split(" used ")[1] for _, why in gpu_overlaps(runs, WORKERS_IDLE)] == [
        "the worker (it runs one job at a time) for 0.500s beside the trainer of j_a (attempt a_1)"
    ]
    assert run({"j_a": job("failed", last_error="x")}, runs=runs).inconsistent[0][0] == "j_a"


def test_a_job_its_agent_would_not_start_where_it_was_placed_is_inconsistent():
    refused = "not started on this worker: GPU 1 is in use by job j_b"
    result = run({"j_a": job("failed", last_error=refused), "j_c": job("failed", last_error="worker lost: retries exhausted")})
    assert result.lost == []
    assert result.inconsistent == [
        ("j_a", "failed without running: its agent would not start it where it was placed (GPU 1 is in use by job j_b)")
    ]


def test_the_summary_counts_the_most_trainers_running_at_once_per_worker():
    runs = [
        {"worker_id": "w_p", "start": 1.0, "end": 3.0}, {"worker_id": "w_p", "start": 2.0, "end": 4.0},
        {"worker_id": "w_p", "start": 3.0, "end": 5.0}, {"worker_id": "w_1", "start": 1.0, "end": 2.0},
    ]  # fmt: skip
    assert most_at_once(runs) == {"w_p": 2, "w_1": 1}  # one ending as another starts is not at once


# --- multi-node jobs (gangs): one member per (job, attempt, rank), each on its own worker --------------------------


def gang(status, *, lease="a_2", worker_id="w_1", last_error=""):
    return {"status": status, "last_error": last_error, "worker_id": worker_id, "num_nodes": 2, "lease_id": lease, "gpu_count": 0}


def member(lease, rank, worker_id, outcome="completed", job_id="j_g"):
    return {"job_id": job_id, "lease_id": lease, "rank": rank, "worker_id": worker_id, "gpu_indices": None, "outcome": outcome}


def rank_line(attempt, rank, worker_id, job_id="j_g", port=29500):
    return {
        **line(job_id, attempt), "rank": rank, "nnodes": 2, "master_addr": "127.0.0.1", "master_port": port,
        "job_dir": f"/soak/agents/x/jobs/{worker_id}/{job_id}", "cuda_visible_devices": None,
    }  # fmt: skip


# Attempt a_1 was stopped (rank 1's agent killed) after rank 0 completed; a_2 completed both ranks.
GANG_MEMBERS = [member("a_1", 0, "w_1"), member("a_1", 1, "w_2", "lost"), member("a_2", 0, "w_1"), member("a_2", 1, "w_2")]
GANG_LEDGER = [rank_line("a_1", 0, "w_1"), rank_line("a_2", 0, "w_1"), rank_line("a_2", 1, "w_2")]
TWO_IDLE = {
    "w_1": {"name": "gpu-1", "status": "idle", "current_job_id": None, "gang_rank": 0},
    "w_2": {"name": "gpu-2", "status": "idle", "current_job_id": None, "gang_rank": 0},
}


def gang_run(status="completed", *, ledger=GANG_LEDGER, members=GANG_MEMBERS, completed=("a_2",), **kwargs):
    return run(
        {"j_g": gang(status, last_error="" if status == "completed" else "retries exhausted")},
        ledger=ledger, completed={"j_g": list(completed)}, workers=TWO_IDLE, members=members, **kwargs,
    )  # fmt: skip


def test_a_gang_completed_once_passes_beside_a_stopped_attempt_with_some_ranks_done():
    result = gang_run()
    assert (result.lost, result.twice, result.inconsistent) == ([], [], [])
    assert result.gangs == {
        "multi-node jobs": 1, "multi-node jobs completed": 1, "multi-node attempts dispatched": 2,
        "multi-node attempts completing every rank": 1, "multi-node attempts stopped with some ranks completed": 1,
        "member trainers started": 0, "member trainers completed (ledger lines)": 3,
    }  # fmt: skip


def test_a_gang_member_that_completed_twice_is_run_twice():
    result = gang_run(ledger=[*GANG_LEDGER, rank_line("a_2", 1, "w_2")])
    assert result.twice == [("j_g", "rank 1 of attempt a_2 completed 2 times (ledger)")]
    assert result.inconsistent == []


def test_a_gang_member_started_twice_is_run_twice_even_unfinished():
    runs, open_runs = trainer_runs([
        {**started("j_g", "a_2", 10, 1.0, worker_id="w_2"), "rank": 1}, {**started("j_g", "a_2", 11, 2.0, worker_id="w_2"), "rank": 1},
        ended("j_g", "a_2", 11, 3.0),
    ])  # fmt: skip
    result = gang_run(runs=runs, open_runs=open_runs)
    assert result.twice == [("j_g", "rank 1 of attempt a_2 started 2 times (runs file)")]
    _, one_node = trainer_runs([started("j_a", "a_1", 10, 1.0, worker_id="w_1"), started("j_a", "a_1", 11, 2.0, worker_id="w_1")])
    assert run({"j_a": job("failed", last_error="x")}, open_runs=one_node).twice == [("j_a", "attempt a_1 started 2 times (runs file)")]


def test_two_attempts_that_each_completed_every_rank_are_completed_twice():
    result = gang_run(ledger=[*GANG_LEDGER, rank_line("a_1", 1, "w_2")])
    assert result.twice == [("j_g", "2 attempts completed every rank: a_1, a_2")]


def test_a_gang_completed_with_a_missing_rank_is_inconsistent():
    result = gang_run(ledger=GANG_LEDGER[:2])  # a_2's rank 1 never completed, yet the database completed a_2
    assert result.inconsistent == [("j_g", "completed with a rank missing: attempt a_2 has ledger lines of ranks [0] of 2")]
    assert result.twice == []


def test_a_gang_not_completed_although_an_attempt_completed_every_rank_is_inconsistent():
    assert gang_run("failed").inconsistent == [("j_g", "failed although attempt a_2 completed every rank")]
    stopped = gang_run("failed", ledger=GANG_LEDGER[:1])  # only a stopped attempt's rank 0: completes nothing
    assert (stopped.lost, stopped.inconsistent) == ([], [])


def test_two_ranks_of_one_attempt_on_one_worker_are_inconsistent():
    members = [*GANG_MEMBERS[:2], member("a_2", 0, "w_1"), member("a_2", 1, "w_1")]
    ledger = [*GANG_LEDGER[:2], rank_line("a_2", 1, "w_1")]
    assert gang_run(members=members, ledger=ledger).inconsistent == [("j_g", "ranks 0, 1 of attempt a_2 on one worker, w_1")]
    ran_beside = gang_run(ledger=[*GANG_LEDGER[:2], rank_line("a_2", 1, "w_1")])  # rank 1 ran where rank 0 is
    assert ran_beside.inconsistent == [
        ("j_g", "rank 1 of attempt a_2 completed on worker w_1; that member is w_2"),
        ("j_g", "ranks 0, 1 of attempt a_2 on one worker, w_1"),
    ]


def test_a_member_line_must_match_its_attempts_members_and_rendezvous():
    ledger = [*GANG_LEDGER[:2], rank_line("a_2", 1, "w_2", port=29501), rank_line("a_3", 2, "w_2")]
    assert gang_run(ledger=ledger).inconsistent == [
        ("j_g", "a trainer of attempt a_3 completed as rank 2 of 2 nodes; the job has 2"),
        ("j_g", "the ranks of attempt a_2 were told different rendezvous: 127.0.0.1:29500, 127.0.0.1:29501"),
    ]


def busy(name, job_id, rank):
    return {"name": name, "status": "busy", "current_job_id": job_id, "gang_rank": rank}


def test_a_running_gang_is_held_by_each_member_under_its_rank():
    jobs = {"j_g": gang("running")}
    members = [member("a_1", 0, "w_1", "stopped"), member("a_1", 1, "w_2", "lost"), member("a_2", 0, "w_1", ""), member("a_2", 1, "w_3", "")]
    workers = {"w_1": busy("gpu-1", "j_g", 0), "w_2": busy("gpu-2", "j_g", 1), "w_3": busy("gpu-3", "j_g", 1)}
    assert placement_findings(jobs, workers, members) == [  # w_2 waits for its agent, but rank 1 is w_3's now
        ("j_g", "workers gpu-2, gpu-3 hold job j_g under one rank, 1"),
    ]
    workers["w_2"] = busy("gpu-2", None, 0) | {"status": "idle"}
    assert placement_findings(jobs, workers, members) == []
    workers["w_3"] = busy("gpu-3", "j_g", 0)
    assert placement_findings(jobs, workers, members) == [
        ("j_g", "rank 1 of attempt a_2 runs on gpu-3, whose current job is j_g (rank 0)"),
        ("j_g", "workers gpu-1, gpu-3 hold job j_g under one rank, 0"),
        ("w_3", "worker gpu-3 holds job j_g under rank 0, but it is rank 1 of attempt a_2"),
    ]


def test_a_stopped_members_worker_holds_the_gang_job_only_while_busy_and_not_after_the_drain():
    jobs = {"j_g": gang("queued", lease="")}
    members = [member("a_1", 0, "w_1", "stopped"), member("a_1", 1, "w_2", "lost")]
    workers = {"w_1": busy("gpu-1", "j_g", 0), "w_2": busy("gpu-2", None, 0) | {"status": "offline"}}
    assert placement_findings(jobs, workers, members) == []  # its agent has not said yet it stopped the trainer
    assert placement_findings(jobs, workers, members, settled=True) == [
        ("w_1", "worker gpu-1 holds job j_g after the drain, though its member (rank 0 of attempt a_1) ended stopped")
    ]
    workers["w_1"] = busy("gpu-1", None, 0) | {"status": "idle"}
    workers["w_2"] = busy("gpu-2", "j_g", 1) | {"status": "idle"}
    workers["w_3"] = busy("gpu-3", "j_g", 0)  # no member of it ever
    assert placement_findings(jobs, workers, members) == [
        ("w_2", "worker gpu-2 holds job j_g while idle, though its member (rank 1 of attempt a_1) ended lost"),
        ("w_3", "worker gpu-3 holds job j_g (queued) under rank 0, but is no member of it under that rank"),
    ]


def test_an_active_gangs_attempt_has_every_rank_with_rank_0_on_the_jobs_worker():
    jobs = {"j_g": gang("dispatched", worker_id="w_2")}
    members = [member("a_2", 0, "w_1", "")]
    workers = {"w_1": busy("gpu-1", "j_g", 0), "w_2": busy("gpu-2", None, 0) | {"status": "idle"}}
    assert placement_findings(jobs, workers, members) == [
        ("j_g", "dispatched as a 2-node job whose attempt a_2 has ranks [0]"),
        ("j_g", "dispatched on w_2, but rank 0 of attempt a_2 is on w_1"),
    ]


def test_a_gang_member_on_a_packing_worker_counts_among_what_it_holds():
    jobs = {"j_g": {**gang("running", worker_id="w_1"), "gpu_count": 1}, "j_a": placed("running", [0])}
    members = [member("a_2", 0, "w_1", ""), {**member("a_2", 1, "w_p", ""), "gpu_indices": [1]}]
    workers = {"w_1": busy("gpu-1", "j_g", 0), "w_p": packer(gpus_free=2)}
    assert placement_findings(jobs, workers, members) == []
    members[1]["gpu_indices"] = [0]
    assert placement_findings(jobs, workers, members) == [
        ("w_p", "GPU 0 of packing worker pack-1 held by 2 jobs at once: j_a, j_g rank 1"),
        ("w_p", "packing worker pack-1 says gpus_free 2; its 4 slots less its 2 jobs' GPUs leave 3"),
    ]
    # A stopped member whose agent still runs it keeps its GPU, as its row says (holds_gpus), the job requeued.
    ended = [member("a_1", 0, "w_1", "stopped"), {**member("a_1", 1, "w_p", "stopped"), "gpu_indices": [1], "holds_gpus": True}]
    queued = {**jobs, "j_g": {**jobs["j_g"], "status": "queued", "lease_id": ""}}
    workers = {**TWO_IDLE, "w_p": packer(gpus_free=2)}
    assert placement_findings(queued, workers, ended) == []
    ended[1]["holds_gpus"] = False
    assert placement_findings(queued, workers, ended) == [
        ("w_p", "packing worker pack-1 says gpus_free 2; its 4 slots less its 1 jobs' GPUs leave 3")
    ]
