"""The soak's audit: from the database's final state and the trainers' ledger, what was lost, twice, inconsistent.

Pure functions over plain rows, so the rules are tested without a fleet (``test_audit.py``). The rules:

- **lost**: a submitted job that did not end ``completed``, nor ``failed`` with a reason (``last_error``):
  still queued, dispatched or running, cancelled (the soak never cancels), failed without a reason, or
  missing from the database.
- **completed twice**: a job id with more than one line in the ledger (its trainer ran to the end twice), except
  a **late duplicate** (C, by design, counted apart): lines of distinct attempts, one of them the attempt the
  database completed, every other ended by the orchestrator without its worker's word (``TAKEN_BACK``: declared
  lost, never acknowledged, interrupted, superseded). That is a trainer that completed while its agent was down
  longer than the heartbeat timeout, whose result arrived after another attempt had completed the job: the
  orchestrator kept one result and refused the other. Each attempt ran once, which is the issue's rule ("no member
  of an attempt ever runs twice"); what is never allowed is one attempt run twice, or two results accepted.
- **inconsistent**: a completed job without exactly one ledger line, or whose ledger line is not the
  attempt the database says completed (or that has not exactly one completed attempt); a job that is not
  completed although a trainer of it completed; a job failed because its agent would not start it where the
  orchestrator placed it (``not started on this worker: GPU 1 is in use by job ...``); a ledger line for a
  job never submitted; a ledger or runs line that is unreadable; a job still dispatched or running at the
  end; a trainer process still alive at the end; a completed trainer that did not see the GPUs its attempt
  was given (``CUDA_VISIBLE_DEVICES``); two trainers at once on one worker or GPU (``gpu_overlaps``); and
  whatever ``placement_findings`` finds in the final state, or found in the snapshots the soak took while it
  ran.

``gpu_overlaps`` checks the trainers themselves, from the start and end lines each wrote (the runs file): two
trainers that ran at the same time on one worker are inconsistent when that worker runs one job at a time, or
when they used a GPU in common on a packing worker (a trainer given no ``CUDA_VISIBLE_DEVICES`` there had the
whole worker, every slot).

**Multi-node jobs (gangs).** A job with ``num_nodes`` N > 1 runs as N members per attempt (one lease), each a
trainer run with its rank (``NODE_RANK``) on its own worker (``GangMember`` rows, table ``queue_gangmember``). A
member's unit is (job, attempt, rank): it may run at most once. An attempt *completed* when every rank 0..N-1 of it
has a ledger line; an attempt that was stopped (a member failed or was lost, the others told to stop) may leave
ledger lines of some of its ranks, which complete nothing. So, per gang job (``gang_findings``):

- **completed twice**: one (job, attempt, rank) with two ledger lines, or two start lines in the runs file (a
  member run twice, finished or not); or two attempts of the job that each completed every rank (the job's training
  done twice, whatever the database says).
- **inconsistent**: a completed job whose one completed attempt (the database's) lacks a rank's ledger line (``the
  gang completed with a missing rank``), or that has no such attempt; a job not completed although an attempt of it
  completed every rank; a ledger line whose rank is outside 0..N-1 or whose ``NNODES`` is not N, or with no member
  row of that attempt and rank, or run on another worker than that member's; two ranks of one attempt on one worker
  (by its member rows, or by where its trainers ran); ranks of one attempt told different rendezvous
  (``MASTER_ADDR``/``MASTER_PORT``); a completed member trainer that did not see its member's GPUs.

``placement_findings`` checks where the jobs are, in one consistent read of the database. For a worker that
runs one job at a time: an active job's worker holds it as its ``current_job``; a busy worker has a current
job; a worker's current job is active and assigned to it. For a packing worker (``max_jobs`` > 1, which keeps
its jobs as the jobs with ``holds_gpus`` on it, not as ``current_job``): an active job on it is among the jobs
it holds; a job it holds is active; a busy one holds at least one; each job it holds has as many of its GPU
slots as it needs (all of them for a job that needs 0); no GPU index is held by two jobs at once; online
(idle, busy, draining), its ``gpus_free`` is its slots less its jobs' GPUs (0 once it holds ``max_jobs`` jobs, as
``job_queue.packing.room`` says); offline (or never connected), it holds no job and its ``gpus_free`` is 0 (a
lost worker's jobs are requeued, and it is offered nothing).

Gangs in ``placement_findings``: the job's ``worker`` is rank 0's. Each live member (no outcome) of an active gang
job's current attempt is held by its worker, as its ``current_job`` under its rank (``gang_rank``) on a worker that
does not pack, or among the jobs a packing worker holds; the attempt's ranks are 0..N-1 on N distinct workers, rank
0's the job's worker. A worker that does not pack may hold a gang job as its current job when it is a live member of
its current attempt under that rank, or when it was a member of an attempt of it that ended (stopped or lost, its
agent not yet saying it runs it no more), busy: it holds the job and its GPUs until then, so nothing is given twice.
No two workers hold one job under one rank. A packing worker holds a gang member when the member row says so
(``holds_gpus``, where the database has that column), else while it is a live member.
"""

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

ACTIVE = ("dispatched", "running")
# How an agent reports a job_submit it would not start (worker_agent/jobs.py): here, where the orchestrator put
# the job (GPUs a job of the agent still holds, the whole worker while one runs) is not free on the agent.
NOT_STARTED = "not started on this worker: "
ONLINE = ("idle", "busy", "draining")  # workers.models.WORKER_ONLINE: an agent holds a session


@dataclass
class AuditResult:
    submitted: int
    by_status: Counter
    failed_reasons: Counter
    ledger_lines: int
    lost: list = field(default_factory=list)  # (job_id, why)
    twice: list = field(default_factory=list)  # (job_id, number of ledger lines)
    late_duplicates: list = field(default_factory=list)  # (job_id, why): C, by design (the module's rules)
    inconsistent: list = field(default_factory=list)  # (subject, why)
    gangs: dict = field(default_factory=dict)  # the multi-node jobs' figures (gang_figures)

    @property
    def passed(self):
        return not (self.lost or self.twice or self.inconsistent)

    def flagged_jobs(self):
        """Return the job ids named by a finding, in order of first mention."""
        seen = {}
        for job_id, _ in [*self.twice, *self.lost, *self.inconsistent]:
            if job_id.startswith("j_"):
                seen.setdefault(job_id, None)
        return list(seen)


def stamp(epoch):
    """Return ``HH:MM:SS.mmm`` (UTC) of ``epoch``: the database's timestamps are UTC too."""
    return datetime.fromtimestamp(epoch, timezone.utc).strftime("%H:%M:%S.%f")[:-3]


def parse_ledger(text):
    """Return ``(records, bad_lines)``: the ledger's JSON lines as dicts, and the lines that are not one."""
    records, bad = [], []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad.append(line)
            continue
        if not isinstance(record, dict) or not isinstance(record.get("job_id"), str):
            bad.append(line)
            continue
        records.append(record)
    return records, bad


def audit(
    *,
    submitted_ids,
    jobs,
    workers,
    completed_attempts,
    ledger,
    bad_ledger_lines=(),
    stray_trainers=(),
    attempt_gpus=None,
    snapshot_findings=(),
    runs=(),
    open_runs=(),
    bad_runs_lines=(),
    members=(),
    attempt_outcomes=None,
):
    """Return the AuditResult of one soak.

    ``jobs``: ``{job_id: {"status", "last_error", "worker_id", "gpu_count", "gpu_indices", "holds_gpus"}}`` for
    every job of the soak in the database (the last three may be absent: no GPUs). ``workers``: ``{worker_id:
    {"name", "status", "current_job_id", "max_jobs", "gpu_slots", "gpus_free"}}`` (the last three may be
    absent: a worker that does not pack). ``completed_attempts``: ``{job_id: [lease ids of attempts whose
    outcome is completed]}``. ``ledger``: the ledger records (``parse_ledger``). ``stray_trainers``:
    descriptions of trainer processes still alive after the drain. ``attempt_gpus``: ``{lease id:
    CUDA_VISIBLE_DEVICES its trainer must see (None: unset)}`` for the completed attempts, checked against
    the ledger lines that record it. ``snapshot_findings``: ``(subject, why)`` that ``placement_findings``
    found while the soak ran. ``runs``: the trainers' runs with a start and an end (``trainer_runs``), checked
    by ``gpu_overlaps``; ``open_runs``, those with no end (a member run twice is found from every start line);
    ``bad_runs_lines``, the runs file's lines that are not one. ``members``: the ``GangMember`` rows of the soak's
    jobs, each ``{"job_id", "lease_id", "rank", "worker_id", "gpu_indices", "outcome"}`` (and ``holds_gpus``
    where the database has it); a job row's ``num_nodes`` (absent: 1) and ``lease_id`` say which jobs are gangs
    and which attempt is current (``gang_findings``, ``placement_findings``). ``attempt_outcomes``: ``{lease id:
    outcome}`` of every attempt, which tells a late duplicate from a job completed twice (None: none is one).
    """
    submitted_ids = list(submitted_ids)
    result = AuditResult(
        submitted=len(submitted_ids),
        by_status=Counter(job["status"] for job in jobs.values()),
        failed_reasons=Counter(
            (job["last_error"].strip() or "(no reason)").splitlines()[0][:80]
            for job in jobs.values()
            if job["status"] == "failed"
        ),
        ledger_lines=len(ledger) + len(bad_ledger_lines),
    )
    lines_of = defaultdict(list)
    for record in ledger:
        lines_of[record["job_id"]].append(record)
    gang_ids = {job_id for job_id, job in jobs.items() if is_gang(job)}

    for job_id in submitted_ids:
        job = jobs.get(job_id)
        if job is None:
            result.lost.append((job_id, "not in the database"))
        elif job["status"] == "completed":
            continue
        elif job["status"] == "failed" and (job["last_error"] or "").strip():
            continue
        elif job["status"] == "failed":
            result.lost.append((job_id, "failed without a reason"))
        else:
            result.lost.append((job_id, f"{job['status']} at the end"))

    for job_id, records in list(lines_of.items()):
        if len(records) > 1 and job_id not in gang_ids:  # a gang's member lines: gang_findings
            kept = late_duplicate(jobs.get(job_id), records, completed_attempts.get(job_id, []), attempt_outcomes)
            if kept is None:
                result.twice.append((job_id, len(records)))
                continue
            others = ", ".join(f"{r.get('attempt')} ({attempt_outcomes[r.get('attempt')]})" for r in records if r is not kept)
            result.late_duplicates.append((job_id, f"completed by {kept.get('attempt')}; also ran to the end: {others}"))
            lines_of[job_id] = [kept]  # the result the orchestrator kept: checked below as any completion
    starts = [*runs, *open_runs]
    result.twice.extend(runs_twice(starts))

    known = set(submitted_ids) | set(jobs)
    for job_id, records in lines_of.items():
        if job_id not in known:
            result.inconsistent.append((job_id, f"{len(records)} ledger line(s) for a job never submitted"))
    for line in bad_ledger_lines:
        result.inconsistent.append(("ledger", f"unreadable ledger line: {line[:120]!r}"))
    for line in bad_runs_lines:
        result.inconsistent.append(("runs", f"unreadable runs line: {line[:120]!r}"))

    for job_id, job in jobs.items():
        records = lines_of.get(job_id, [])
        status = job["status"]
        if job_id in gang_ids:
            twice, inconsistent = gang_findings(
                job_id, job, records, [run for run in starts if run["job_id"] == job_id],
                [member for member in members if member["job_id"] == job_id], completed_attempts.get(job_id, []),
            )  # fmt: skip
            result.twice.extend(twice)
            result.inconsistent.extend(inconsistent)
        elif status == "completed":
            leases = completed_attempts.get(job_id, [])
            if len(records) != 1:
                result.inconsistent.append((job_id, f"completed with {len(records)} ledger lines"))
            if len(leases) != 1:
                result.inconsistent.append((job_id, f"completed with {len(leases)} completed attempts"))
            elif len(records) == 1 and records[0].get("attempt") != leases[0]:
                why = f"the trainer that completed ran attempt {records[0].get('attempt')}, the database completed {leases[0]}"
                result.inconsistent.append((job_id, why))
        elif records:
            result.inconsistent.append((job_id, f"{status} although {len(records)} trainer run(s) of it completed"))
        if status == "failed" and (job["last_error"] or "").startswith(NOT_STARTED):
            why = job["last_error"].splitlines()[0][len(NOT_STARTED) :][:160]
            result.inconsistent.append((job_id, f"failed without running: its agent would not start it where it was placed ({why})"))
        if status in ACTIVE:
            result.inconsistent.append((job_id, f"left {status} after the drain"))

    for record in ledger:
        lease = record.get("attempt")
        if record["job_id"] in gang_ids:  # its member's GPUs: gang_findings
            continue
        if attempt_gpus and lease in attempt_gpus and "cuda_visible_devices" in record:
            seen, given = record["cuda_visible_devices"], attempt_gpus[lease]
            if seen != given:
                why = f"the trainer of attempt {lease} saw CUDA_VISIBLE_DEVICES={seen}; its attempt was given {given}"
                result.inconsistent.append((record["job_id"], why))

    result.inconsistent.extend(placement_findings(jobs, workers, members, settled=True))
    result.inconsistent.extend(snapshot_findings)
    result.inconsistent.extend(gpu_overlaps(runs, workers))
    for trainer in stray_trainers:
        result.inconsistent.append(("trainer", f"trainer still running after the drain: {trainer}"))
    result.gangs = gang_figures(jobs, ledger, starts, members)
    return result


TAKEN_BACK = frozenset({"lost", "unacknowledged", "interrupted", "superseded"})


def late_duplicate(job, records, completed_leases, attempt_outcomes):
    """Return the ledger record the orchestrator kept when one-node ``job``'s ledger ``records`` (two or more) are
    a late duplicate (C: the module's rules), else None: distinct attempts, the job completed by exactly one of
    them, every other taken back by the orchestrator (``TAKEN_BACK``)."""
    if job is None or job["status"] != "completed" or attempt_outcomes is None or len(completed_leases) != 1:
        return None
    attempts = [record.get("attempt") for record in records]
    if len(set(attempts)) != len(attempts) or completed_leases[0] not in attempts:
        return None
    if any(attempt_outcomes.get(lease) not in TAKEN_BACK for lease in attempts if lease != completed_leases[0]):
        return None
    return records[attempts.index(completed_leases[0])]


def is_gang(job):
    """Whether ``job`` (a row of ``audit``'s ``jobs``) is a multi-node job."""
    return (job.get("num_nodes") or 1) > 1


def ran_on(record):
    """The worker id a ledger or runs record's trainer ran on (its job dir's parent: ``<work dir>/<worker id>/<job id>``)."""
    return record.get("worker_id") or Path(record.get("job_dir") or "").parent.name


def _member_name(attempt, rank):
    return f"attempt {attempt}" if rank is None else f"rank {rank} of attempt {attempt}"


def runs_twice(starts):
    """Return ``(job_id, why)`` for each member (job, attempt, rank; rank None for a one-node job) with two or more
    start lines among ``starts`` (``trainer_runs``' runs, ended or not): a member of an attempt run twice."""
    counts = Counter((run["job_id"], run["attempt"], run.get("rank")) for run in starts)
    return [
        (job_id, f"{_member_name(attempt, rank)} started {n} times (runs file)")
        for (job_id, attempt, rank), n in counts.items()
        if n > 1
    ]


def _visible(member, job):
    """The ``CUDA_VISIBLE_DEVICES`` a gang ``member``'s trainer must see: its GPUs, None for a whole-worker job."""
    indices = member.get("gpu_indices")
    return ",".join(str(index) for index in indices) if indices is not None and job.get("gpu_count") else None


def gang_findings(job_id, job, records, starts, members, completed_leases):
    """Return ``(twice, inconsistent)`` for multi-node ``job`` (the module's rules for gangs): from its ledger
    ``records``, the start lines of its trainers ``starts`` (``trainer_runs``' runs), its ``members`` (the rows of
    every attempt) and ``completed_leases`` (its attempts the database completed)."""
    twice, inconsistent = [], []
    nodes, status = job["num_nodes"], job["status"]
    for (attempt, rank), n in Counter((record.get("attempt"), record.get("rank")) for record in records).items():
        if n > 1:
            twice.append((job_id, f"{_member_name(attempt, rank)} completed {n} times (ledger)"))
    member_at = {(member["lease_id"], member["rank"]): member for member in members}
    ranks_of = defaultdict(set)  # attempt -> the ranks with a ledger line
    for record in records:
        attempt, rank = record.get("attempt"), record.get("rank")
        if not isinstance(rank, int) or not 0 <= rank < nodes or record.get("nnodes") != nodes:
            why = f"a trainer of attempt {attempt} completed as rank {rank} of {record.get('nnodes')} nodes; the job has {nodes}"
            inconsistent.append((job_id, why))
            continue
        ranks_of[attempt].add(rank)
        member, where = member_at.get((attempt, rank)), ran_on(record)
        if member is None:
            inconsistent.append((job_id, f"rank {rank} of attempt {attempt} completed, but that attempt has no such member"))
        elif where != member["worker_id"]:
            why = f"rank {rank} of attempt {attempt} completed on worker {where}; that member is {member['worker_id']}"
            inconsistent.append((job_id, why))
        elif "cuda_visible_devices" in record and record["cuda_visible_devices"] != _visible(member, job):
            why = (
                f"rank {rank} of attempt {attempt} saw CUDA_VISIBLE_DEVICES={record['cuda_visible_devices']}; "
                f"its member was given {_visible(member, job)}"
            )
            inconsistent.append((job_id, why))
    full = sorted(attempt for attempt, ranks in ranks_of.items() if ranks == set(range(nodes)))
    if len(full) > 1:
        twice.append((job_id, f"{len(full)} attempts completed every rank: {', '.join(map(str, full))}"))
    if status == "completed":
        if len(completed_leases) != 1:
            inconsistent.append((job_id, f"completed with {len(completed_leases)} completed attempts"))
        elif completed_leases[0] not in full:
            lease = completed_leases[0]
            why = f"completed with a rank missing: attempt {lease} has ledger lines of ranks {sorted(ranks_of[lease])} of {nodes}"
            inconsistent.append((job_id, why))
    elif full:
        inconsistent.append((job_id, f"{status} although attempt {full[0]} completed every rank"))
    on_worker = defaultdict(lambda: defaultdict(set))  # attempt -> worker -> its ranks (member rows and runs alike)
    rendezvous = defaultdict(set)  # attempt -> (MASTER_ADDR, MASTER_PORT) its ranks were told
    for member in members:
        if member["worker_id"] is not None:
            on_worker[member["lease_id"]][member["worker_id"]].add(member["rank"])
    for run in [*starts, *records]:
        if isinstance(run.get("rank"), int):
            on_worker[run["attempt"]][ran_on(run)].add(run["rank"])
            rendezvous[run["attempt"]].add((run.get("master_addr"), run.get("master_port")))
    for attempt, workers in on_worker.items():
        for worker_id, ranks in workers.items():
            if len(ranks) > 1:
                why = f"ranks {', '.join(map(str, sorted(ranks)))} of attempt {attempt} on one worker, {worker_id}"
                inconsistent.append((job_id, why))
    for attempt, seen in rendezvous.items():
        if len(seen) > 1:
            told = ", ".join(f"{addr}:{port}" for addr, port in sorted(seen, key=str))
            inconsistent.append((job_id, f"the ranks of attempt {attempt} were told different rendezvous: {told}"))
    return twice, inconsistent


def gang_figures(jobs, ledger, starts, members):
    """Return the summary's figures of the multi-node jobs: how many, their attempts, completions and member runs."""
    gang_jobs = {job_id: job for job_id, job in jobs.items() if is_gang(job)}
    lines = [record for record in ledger if record["job_id"] in gang_jobs]
    ranks_of = defaultdict(set)
    for record in lines:
        ranks_of[(record["job_id"], record.get("attempt"))].add(record.get("rank"))
    full = {key for key, ranks in ranks_of.items() if ranks == set(range(gang_jobs[key[0]]["num_nodes"]))}
    attempts = {(member["job_id"], member["lease_id"]) for member in members if member["job_id"] in gang_jobs}
    return {
        "multi-node jobs": len(gang_jobs),
        "multi-node jobs completed": sum(job["status"] == "completed" for job in gang_jobs.values()),
        "multi-node attempts dispatched": len(attempts),
        "multi-node attempts completing every rank": len(full),
        "multi-node attempts stopped with some ranks completed": len(set(ranks_of) - full),
        "member trainers started": sum(run["job_id"] in gang_jobs for run in starts),
        "member trainers completed (ledger lines)": len(lines),
    }


def trainer_runs(records):
    """Return ``(runs, open_runs)`` from the runs file's records (``parse_ledger``): each run a dict ``job_id,
    attempt, worker_id`` (its job dir's parent: ``<work dir>/<worker id>/<job id>``), ``rank, master_addr,
    master_port`` (None each for a one-node job), ``gpus`` (its
    ``CUDA_VISIBLE_DEVICES`` as a list of ints, or None), ``start``, ``end``; ``open_runs``, the starts with no
    end line (a trainer killed by SIGKILL, or stopped before it could write one)."""
    ends = {(r.get("pid"), r.get("attempt")): r["time"] for r in records if r.get("event") == "end"}
    runs, open_runs = [], []
    for record in records:
        if record.get("event") != "start":
            continue
        devices = record.get("cuda_visible_devices")
        run = {
            "job_id": record["job_id"], "attempt": record.get("attempt"), "worker_id": ran_on(record),
            "rank": record.get("rank"), "master_addr": record.get("master_addr"), "master_port": record.get("master_port"),
            "gpus": None if devices is None else [int(index) for index in devices.split(",") if index.strip()],
            "start": record["time"], "end": ends.get((record.get("pid"), record.get("attempt"))),
        }  # fmt: skip
        (open_runs if run["end"] is None else runs).append(run)
    return runs, open_runs


def gpu_overlaps(runs, workers):
    """Return ``(subject, why)`` for each two ``runs`` (``trainer_runs``) on one worker of ``workers`` that overlap in
    time and in what they used: the worker, on one that runs one job at a time; a GPU, on a packing worker."""
    found = []
    by_worker = defaultdict(list)
    for run in runs:
        by_worker[run["worker_id"]].append(run)
    for worker_id, on_worker in by_worker.items():
        worker = workers.get(worker_id) or {"name": worker_id}
        slots = set(worker.get("gpu_slots") or ()) if packs(worker) else None
        on_worker.sort(key=lambda run: run["start"])
        for index, first in enumerate(on_worker):
            for later in on_worker[index + 1 :]:
                if later["start"] >= first["end"]:
                    break
                if slots is None:
                    shared = "the worker (it runs one job at a time)"
                else:
                    common = set(first["gpus"] if first["gpus"] is not None else slots)
                    common &= set(later["gpus"] if later["gpus"] is not None else slots)
                    if not common:
                        continue
                    shared = f"GPU {','.join(map(str, sorted(common)))}"
                overlap = min(first["end"], later["end"]) - later["start"]
                found.append((later["job_id"], (
                    f"its trainer (attempt {later['attempt']}) started on {worker['name']} at {stamp(later['start'])} and used "
                    f"{shared} for {overlap:.3f}s beside the trainer of {first['job_id']} (attempt {first['attempt']})"
                )))  # fmt: skip
    return found


def packs(worker):
    """Whether ``worker`` (a row of ``placement_findings``'s ``workers``) runs several jobs at once."""
    return (worker.get("max_jobs") or 1) > 1


def placement_findings(jobs, workers, members=(), *, settled=False):
    """Return ``(subject, why)`` for each place where ``jobs``, ``workers`` and gang ``members`` (rows as ``audit``
    takes them, read in one transaction) disagree about which worker holds which job and GPUs (the module's rules).
    ``settled``: the final state, where no worker still waits for its agent to let go of an ended member."""
    found = []
    held_by = defaultdict(list)
    for job_id, job in jobs.items():
        if job.get("holds_gpus"):
            held_by[job["worker_id"]].append(job_id)
    members_held = defaultdict(dict)  # packing worker id -> {"<job id> rank <r>": the gang member it holds}
    for member in members:
        worker, job = workers.get(member["worker_id"]), jobs.get(member["job_id"])
        rank0_held = member["rank"] == 0 and member["job_id"] in held_by[member["worker_id"]]  # counted once
        if worker is not None and packs(worker) and _member_holds(member, job) and not rank0_held:
            members_held[member["worker_id"]][f"{member['job_id']} rank {member['rank']}"] = member
    for job_id, job in jobs.items():
        status = job["status"]
        if status not in ACTIVE:
            continue
        worker = workers.get(job["worker_id"])
        if worker is None:
            found.append((job_id, f"{status} with no worker"))
        elif is_gang(job):
            found.extend(_gang_placement(job_id, job, workers, members, held_by, members_held))
        elif packs(worker):
            if job_id not in held_by[job["worker_id"]]:
                found.append((job_id, f"{status} on packing worker {worker['name']}, which does not hold it among its jobs"))
        elif worker["current_job_id"] != job_id:
            found.append((job_id, f"{status} on {worker['name']}, whose current job is {worker['current_job_id']}"))

    holders = defaultdict(list)  # (job, rank) -> the workers that do not pack holding it as their current job
    for worker_id, worker in workers.items():
        if worker["current_job_id"] and not packs(worker):
            holders[(worker["current_job_id"], worker.get("gang_rank", 0))].append(worker["name"])
    for (job_id, rank), names in holders.items():
        if len(names) > 1:
            found.append((job_id, f"workers {', '.join(sorted(names))} hold job {job_id} under one rank, {rank}"))
    for worker_id, worker in workers.items():
        current = worker["current_job_id"]
        if packs(worker):
            held = {job_id: jobs[job_id] for job_id in held_by[worker_id]}
            found.extend(_packing_findings(worker_id, worker, held, members_held[worker_id], jobs))
        elif worker["status"] == "busy" and not current:
            found.append((worker_id, f"worker {worker['name']} busy without a current job"))
        if current:
            job = jobs.get(current)
            holds = f"worker {worker['name']} holds job {current}"
            if job is not None and is_gang(job):
                why = _gang_holder(worker_id, worker, current, job, members, settled=settled)
                if why:
                    found.append((worker_id, f"{holds}{why}"))
            elif job is None or job["status"] not in ACTIVE:
                found.append((worker_id, f"{holds}, which is {'unknown' if job is None else job['status']}"))
            elif job["worker_id"] != worker_id:
                found.append((worker_id, f"{holds}, assigned to {job['worker_id']}"))
    return found


def _live(member, job):
    """Whether gang ``member`` runs in ``job``'s current attempt (no outcome yet, the job active under its lease)."""
    return (
        job is not None and not member["outcome"] and job["status"] in ACTIVE and member["lease_id"] == job.get("lease_id")
    )


def _member_holds(member, job):
    """Whether a packing worker holds gang ``member``'s GPUs: as its row says, else while it is live."""
    return bool(member["holds_gpus"]) if "holds_gpus" in member else _live(member, job)


def _gang_placement(job_id, job, workers, members, held_by, members_held):
    """The findings of active multi-node ``job``'s current attempt: its ranks, their workers, and who holds them."""
    found = []
    nodes, status, lease = job["num_nodes"], job["status"], job.get("lease_id")
    attempt = sorted((member for member in members if member["job_id"] == job_id and member["lease_id"] == lease),
                     key=lambda member: member["rank"])  # fmt: skip
    ranks = [member["rank"] for member in attempt]
    if ranks != list(range(nodes)):
        found.append((job_id, f"{status} as a {nodes}-node job whose attempt {lease} has ranks {ranks}"))
    rank0 = next((member for member in attempt if member["rank"] == 0), None)
    if rank0 is not None and rank0["worker_id"] != job["worker_id"]:
        found.append((job_id, f"{status} on {job['worker_id']}, but rank 0 of attempt {lease} is on {rank0['worker_id']}"))
    on_worker = defaultdict(list)
    for member in attempt:
        on_worker[member["worker_id"]].append(member["rank"])
    for worker_id, on_it in on_worker.items():
        if len(on_it) > 1:
            found.append((job_id, f"ranks {', '.join(map(str, on_it))} of attempt {lease} on one worker, {worker_id}"))
    for member in attempt:
        worker, rank = workers.get(member["worker_id"]), member["rank"]
        if member["outcome"]:
            continue
        if worker is None:
            found.append((job_id, f"rank {rank} of attempt {lease} runs on no worker ({member['worker_id']})"))
        elif packs(worker):
            if f"{job_id} rank {rank}" not in members_held[member["worker_id"]] and job_id not in held_by[member["worker_id"]]:
                found.append((job_id, f"rank {rank} of attempt {lease} on packing worker {worker['name']}, which does not hold it"))
        elif worker["current_job_id"] != job_id or worker.get("gang_rank", 0) != rank:
            why = f"whose current job is {worker['current_job_id']} (rank {worker.get('gang_rank', 0)})"
            found.append((job_id, f"rank {rank} of attempt {lease} runs on {worker['name']}, {why}"))
    return found


def _gang_holder(worker_id, worker, job_id, job, members, *, settled):
    """Why a worker that does not pack should not hold multi-node ``job`` as its current job, or None: it may as a
    live member of the current attempt under its rank, or, busy and not ``settled``, as a member of an ended one."""
    mine = [member for member in members if member["job_id"] == job_id and member["worker_id"] == worker_id]
    rank = worker.get("gang_rank", 0)
    live = [member for member in mine if _live(member, job)]
    if live:
        if live[0]["rank"] == rank:
            return None
        return f" under rank {rank}, but it is rank {live[0]['rank']} of attempt {live[0]['lease_id']}"
    ended = [member for member in mine if member["outcome"] and member["rank"] == rank]
    if not ended:
        return f" ({job['status']}) under rank {rank}, but is no member of it under that rank"
    if settled or worker["status"] not in ("busy", "draining"):
        member = ended[-1]
        state = "after the drain" if settled else f"while {worker['status']}"
        return f" {state}, though its member (rank {rank} of attempt {member['lease_id']}) ended {member['outcome']}"
    return None  # its agent has not yet said it runs it no more: the worker and its GPUs stay held until then


def _packing_findings(worker_id, worker, held, members_held=None, jobs=None):
    """The findings of packing ``worker`` holding the jobs ``held`` (``{job_id: job}``) and the gang members
    ``members_held`` (``{"<job id> rank <r>": member}``; ``jobs`` gives their jobs)."""
    found = []
    name, slots = worker["name"], list(worker.get("gpu_slots") or ())
    holders = defaultdict(list)  # GPU index -> the held jobs (and gang members) on it
    parts = {job_id: (job, job) for job_id, job in held.items()}
    for key, member in (members_held or {}).items():
        parts[key] = (member, (jobs or {}).get(member["job_id"]) or {})
    for job_id, (part, job) in sorted(parts.items()):
        indices = list(part.get("gpu_indices") or ())
        for index in indices:
            holders[index].append(job_id)
        if part is job and job["status"] not in ACTIVE:
            found.append((worker_id, f"packing worker {name} holds job {job_id}, which is {job['status']}"))
        need = job.get("gpu_count") or len(slots)
        if len(indices) != need or not set(indices) <= set(slots):
            found.append((job_id, f"holds GPUs {indices} of {name} (slots {slots}) but needs {need} of them"))
    for index, job_ids in sorted(holders.items()):
        if len(job_ids) > 1:
            found.append((worker_id, f"GPU {index} of packing worker {name} held by {len(job_ids)} jobs at once: {', '.join(job_ids)}"))
    if worker["status"] == "busy" and not parts:
        found.append((worker_id, f"packing worker {name} busy holding no job"))
    if worker["status"] not in ONLINE:
        if parts:
            found.append((worker_id, f"packing worker {name} is {worker['status']} and holds {', '.join(sorted(parts))}"))
        if worker.get("gpus_free") != 0:
            found.append((worker_id, f"packing worker {name} is {worker['status']} and says gpus_free {worker.get('gpus_free')}, not 0"))
        return found
    free = 0 if len(parts) >= worker["max_jobs"] else sum(1 for slot in slots if slot not in holders)
    if worker.get("gpus_free") != free:
        found.append(
            (worker_id, f"packing worker {name} says gpus_free {worker.get('gpus_free')}; its {len(slots)} slots less its {len(parts)} jobs' GPUs leave {free}")
        )
    return found
