"""The soak's audit: from the database's final state and the trainers' ledger, what was lost, twice, inconsistent.

Pure functions over plain rows, so the rules are tested without a fleet (``test_audit.py``). The rules:

- **lost**: a submitted job that did not end ``completed``, nor ``failed`` with a reason (``last_error``):
  still queued, dispatched or running, cancelled (the soak never cancels), failed without a reason, or
  missing from the database.
- **completed twice**: a job id with more than one line in the ledger (its trainer ran to the end twice).
- **inconsistent**: a completed job without exactly one ledger line, or whose ledger line is not the
  attempt the database says completed (or that has not exactly one completed attempt); a job that is not
  completed although a trainer of it completed; a ledger line for a job never submitted, or unreadable;
  a job still dispatched or running at the end; an active job without a worker, or whose worker does
  not hold it as its current job; a busy worker without a current job; a worker whose current job is
  not active or is another worker's; a trainer process still alive at the end.
"""

import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field

ACTIVE = ("dispatched", "running")


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


def audit(*, submitted_ids, jobs, workers, completed_attempts, ledger, bad_ledger_lines=(), stray_trainers=()):
    """Return the AuditResult of one soak.

    ``jobs``: ``{job_id: {"status", "last_error", "worker_id"}}`` for every job of the soak in the database.
    ``workers``: ``{worker_id: {"name", "status", "current_job_id"}}``. ``completed_attempts``: ``{job_id:
    [lease ids of attempts whose outcome is completed]}``. ``ledger``: the ledger records (``parse_ledger``).
    ``stray_trainers``: descriptions of trainer processes still alive after the drain.
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
        if status in ACTIVE:
            result.inconsistent.append((job_id, f"left {status} after the drain"))
            worker = workers.get(job["worker_id"])
            if worker is None:
                result.inconsistent.append((job_id, f"{status} with no worker"))
            elif worker["current_job_id"] != job_id:
                result.inconsistent.append(
                    (job_id, f"{status} on {worker['name']}, whose current job is {worker['current_job_id']}")
                )

    for worker_id, worker in workers.items():
        current = worker["current_job_id"]
        if worker["status"] == "busy" and not current:
            result.inconsistent.append((worker_id, f"worker {worker['name']} busy without a current job"))
        if current:
            job = jobs.get(current)
            holds = f"worker {worker['name']} holds job {current}"
            if job is None or job["status"] not in ACTIVE:
                result.inconsistent.append((worker_id, f"{holds}, which is {'unknown' if job is None else job['status']}"))
            elif job["worker_id"] != worker_id:
                result.inconsistent.append((worker_id, f"{holds}, assigned to {job['worker_id']}"))

    for trainer in stray_trainers:
        result.inconsistent.append(("trainer", f"trainer still running after the drain: {trainer}"))
    return result
