"""The soak's audit: from the database's final state and the trainers' ledger, what was lost, twice, inconsistent.

Pure functions over plain rows, so the rules are tested without a fleet (``test_audit.py``). The rules:

- **lost**: a submitted job that did not end ``completed``, nor ``failed`` with a reason (``last_error``):
  still queued, dispatched or running, cancelled (the soak never cancels), failed without a reason, or
  missing from the database.
- **completed twice**: a job id with more than one line in the ledger (its trainer ran to the end twice).
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

``placement_findings`` checks where the jobs are, in one consistent read of the database. For a worker that
runs one job at a time: an active job's worker holds it as its ``current_job``; a busy worker has a current
job; a worker's current job is active and assigned to it. For a packing worker (``max_jobs`` > 1, which keeps
its jobs as the jobs with ``holds_gpus`` on it, not as ``current_job``): an active job on it is among the jobs
it holds; a job it holds is active; a busy one holds at least one; each job it holds has as many of its GPU
slots as it needs (all of them for a job that needs 0); no GPU index is held by two jobs at once; online
(idle, busy, draining), its ``gpus_free`` is its slots less its jobs' GPUs (0 once it holds ``max_jobs`` jobs, as
``job_queue.packing.room`` says); offline (or never connected), it holds no job and its ``gpus_free`` is 0 (a
lost worker's jobs are requeued, and it is offered nothing).
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
    inconsistent: list = field(default_factory=list)  # (subject, why)

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
    bad_runs_lines=(),
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
    by ``gpu_overlaps``; ``bad_runs_lines``, the runs file's lines that are not one.
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

    for job_id, records in lines_of.items():
        if len(records) > 1:
            result.twice.append((job_id, len(records)))

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
        if status == "completed":
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
        if attempt_gpus and lease in attempt_gpus and "cuda_visible_devices" in record:
            seen, given = record["cuda_visible_devices"], attempt_gpus[lease]
            if seen != given:
                why = f"the trainer of attempt {lease} saw CUDA_VISIBLE_DEVICES={seen}; its attempt was given {given}"
                result.inconsistent.append((record["job_id"], why))

    result.inconsistent.extend(placement_findings(jobs, workers))
    result.inconsistent.extend(snapshot_findings)
    result.inconsistent.extend(gpu_overlaps(runs, workers))
    for trainer in stray_trainers:
        result.inconsistent.append(("trainer", f"trainer still running after the drain: {trainer}"))
    return result


def trainer_runs(records):
    """Return ``(runs, open_runs)`` from the runs file's records (``parse_ledger``): each run a dict ``job_id,
    attempt, worker_id`` (its job dir's parent: ``<work dir>/<worker id>/<job id>``), ``gpus`` (its
    ``CUDA_VISIBLE_DEVICES`` as a list of ints, or None), ``start``, ``end``; ``open_runs``, the starts with no
    end line (a trainer killed by SIGKILL, or stopped before it could write one)."""
    ends = {(r.get("pid"), r.get("attempt")): r["time"] for r in records if r.get("event") == "end"}
    runs, open_runs = [], []
    for record in records:
        if record.get("event") != "start":
            continue
        devices = record.get("cuda_visible_devices")
        run = {
            "job_id": record["job_id"], "attempt": record.get("attempt"), "worker_id": Path(record.get("job_dir") or "").parent.name,
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


def placement_findings(jobs, workers):
    """Return ``(subject, why)`` for each place where ``jobs`` and ``workers`` (rows as ``audit`` takes them,
    read in one transaction) disagree about which worker holds which job and GPUs (the module's rules)."""
    found = []
    held_by = defaultdict(list)
    for job_id, job in jobs.items():
        if job.get("holds_gpus"):
            held_by[job["worker_id"]].append(job_id)
    for job_id, job in jobs.items():
        status = job["status"]
        if status not in ACTIVE:
            continue
        worker = workers.get(job["worker_id"])
        if worker is None:
            found.append((job_id, f"{status} with no worker"))
        elif packs(worker):
            if job_id not in held_by[job["worker_id"]]:
                found.append((job_id, f"{status} on packing worker {worker['name']}, which does not hold it among its jobs"))
        elif worker["current_job_id"] != job_id:
            found.append((job_id, f"{status} on {worker['name']}, whose current job is {worker['current_job_id']}"))

    for worker_id, worker in workers.items():
        current = worker["current_job_id"]
        if packs(worker):
            found.extend(_packing_findings(worker_id, worker, {job_id: jobs[job_id] for job_id in held_by[worker_id]}))
        elif worker["status"] == "busy" and not current:
            found.append((worker_id, f"worker {worker['name']} busy without a current job"))
        if current:
            job = jobs.get(current)
            holds = f"worker {worker['name']} holds job {current}"
            if job is None or job["status"] not in ACTIVE:
                found.append((worker_id, f"{holds}, which is {'unknown' if job is None else job['status']}"))
            elif job["worker_id"] != worker_id:
                found.append((worker_id, f"{holds}, assigned to {job['worker_id']}"))
    return found


def _packing_findings(worker_id, worker, held):
    """The findings of packing ``worker`` holding the jobs ``held`` (``{job_id: job}``)."""
    found = []
    name, slots = worker["name"], list(worker.get("gpu_slots") or ())
    holders = defaultdict(list)  # GPU index -> the held jobs on it
    for job_id, job in sorted(held.items()):
        indices = list(job.get("gpu_indices") or ())
        for index in indices:
            holders[index].append(job_id)
        if job["status"] not in ACTIVE:
            found.append((worker_id, f"packing worker {name} holds job {job_id}, which is {job['status']}"))
        need = job.get("gpu_count") or len(slots)
        if len(indices) != need or not set(indices) <= set(slots):
            found.append((job_id, f"holds GPUs {indices} of {name} (slots {slots}) but needs {need} of them"))
    for index, job_ids in sorted(holders.items()):
        if len(job_ids) > 1:
            found.append((worker_id, f"GPU {index} of packing worker {name} held by {len(job_ids)} jobs at once: {', '.join(job_ids)}"))
    if worker["status"] == "busy" and not held:
        found.append((worker_id, f"packing worker {name} busy holding no job"))
    if worker["status"] not in ONLINE:
        if held:
            found.append((worker_id, f"packing worker {name} is {worker['status']} and holds {', '.join(sorted(held))}"))
        if worker.get("gpus_free") != 0:
            found.append((worker_id, f"packing worker {name} is {worker['status']} and says gpus_free {worker.get('gpus_free')}, not 0"))
        return found
    free = 0 if len(held) >= worker["max_jobs"] else sum(1 for slot in slots if slot not in holders)
    if worker.get("gpus_free") != free:
        found.append(
            (worker_id, f"packing worker {name} says gpus_free {worker.get('gpus_free')}; its {len(slots)} slots less its {len(held)} jobs' GPUs leave {free}")
        )
    return found
