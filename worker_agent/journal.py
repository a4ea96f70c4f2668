"""The outcome journal: a finished job's result on disk until the orchestrator has answered its report.

A trainer's result must outlive the agent that ran it (kill -9, a crash, a reboot): otherwise the job
runs again. The agent writes ``<job dir>/outcome.json`` before it reports the result, and renames it to
``outcome.reported.json`` once the orchestrator has answered the report (accepted or refused). At
start-up, before it registers, the agent reports every ``outcome.json`` still under its work dir.

The file holds ``job_id`` and ``report``: the job status report exactly as it is sent (``status``,
``attempt``, ``exit_code``, ``error``, ``progress``, ``log_tail``).

The agent can die in the instant between its trainer's end and that write. The trainer's supervisor
(supervisor.py) records every end in ``<job dir>/exit.json``, which the agent settles once it has
journaled (or decided not to report) the result; at start-up ``recover_exits`` turns each unsettled
record into an ``outcome.json`` by the same rule the agent applies to a trainer it watched end
(``runner.exit_report``), with the log tail and progress read back from ``train.log``.
"""

import json
import logging
import os
import time
from pathlib import Path

from . import runner, supervisor

logger = logging.getLogger("worker_agent")

OUTCOME_FILE = "outcome.json"  # written before the report; still there = not delivered yet
REPORTED_FILE = "outcome.reported.json"  # the same file once the orchestrator answered the report
FORMAT_VERSION = 1


def outcome_path(job_dir):
    return Path(job_dir) / OUTCOME_FILE


def write_outcome(job_dir, job_id, report):
    """Write ``report`` for ``job_id`` to ``<job_dir>/outcome.json`` atomically and durably; return the path.

    A temp file is written and fsynced, renamed over the target, and the directory is fsynced, so the
    file is either absent or complete, whenever the agent dies. Raise OSError if it cannot be written.
    """
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    record = {"version": FORMAT_VERSION, "job_id": str(job_id), "written_at": time.time(), "report": dict(report)}
    return supervisor.write_json_atomically(job_dir / OUTCOME_FILE, record)


def mark_delivered(path):
    """Rename ``outcome.json`` to ``outcome.reported.json`` (the orchestrator answered); never raise."""
    path = Path(path)
    try:
        os.replace(path, path.with_name(REPORTED_FILE))
        supervisor.fsync_dir(path.parent)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("Could not mark %s delivered: %s", path, exc)


def undelivered(work_dir):
    """Return ``[(path, job_id, report)]`` for every ``outcome.json`` under ``work_dir``, oldest first.

    A file that cannot be read or parsed is logged and skipped (left in place for an operator).
    """
    work_dir = Path(work_dir)
    if not work_dir.is_dir():
        return []
    found = []
    for path in work_dir.glob(f"*/{OUTCOME_FILE}"):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            report = record["report"]
            job_id = str(record.get("job_id") or path.parent.name)
            if not isinstance(report, dict) or not report.get("status"):
                raise ValueError("no report status")
            written = float(record.get("written_at") or 0)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("Ignoring an unreadable job outcome %s: %s", path, exc)
            continue
        found.append((written, str(path), path, job_id, report))
    found.sort(key=lambda item: (item[0], item[1]))
    return [(path, job_id, report) for _, _, path, job_id, report in found]


def recover_exits(work_dir):
    """Journal the result of every trainer whose end no agent handled (an unsettled ``exit.json``).

    Return the job ids journaled. A record whose attempt is journaled already (the agent died between
    the two writes) is just settled; so is one that is no result (``runner.exit_report``: a trainer
    stopped because its agent died, or abandoned); an unreadable one is logged and left in place.
    """
    work_dir = Path(work_dir)
    recovered = []
    for record_path in sorted(work_dir.glob(f"*/{supervisor.EXIT_FILE}")) if work_dir.is_dir() else ():
        job_dir = record_path.parent
        try:
            record = supervisor.exit_record(job_dir)
        except (OSError, ValueError) as exc:
            logger.warning("Ignoring an unreadable trainer exit record %s: %s", record_path, exc)
            continue
        if record is None:
            continue
        job_id, attempt, code = str(record.get("job_id") or job_dir.name), record.get("attempt"), record["returncode"]
        if attempt in _journaled_attempts(job_dir):
            supervisor.settle(job_dir)
            continue
        stop = runner.STOP_AGENT_DIED if record.get("stopped_by_supervisor") else runner.recorded_stop(job_dir, attempt)
        output = runner.read_log(job_dir)
        report = runner.exit_report(
            attempt, code, stop, progress=output.progress, log_tail=output.log_tail(), last_line=output.last_line()
        )
        if report is None:
            logger.info(
                "Job %s (attempt %s) %s before this agent started; not a result to report",
                job_id,
                attempt,
                "was stopped when its agent died" if stop == runner.STOP_AGENT_DIED else f"ended ({runner.describe_exit(code)}) after a stop ({stop})",
            )
        else:
            try:
                write_outcome(job_dir, job_id, report)
            except OSError as exc:
                logger.warning("Could not journal the recorded end of job %s: %s", job_id, exc)
                continue
            logger.info("Job %s (attempt %s) %s while no agent watched: its result is reported", job_id, attempt, report["status"])
            recovered.append(job_id)
        supervisor.settle(job_dir)
    return recovered


def _journaled_attempts(job_dir):
    """The attempts whose outcome is journaled in ``job_dir`` (delivered or not)."""
    attempts = set()
    for name in (OUTCOME_FILE, REPORTED_FILE):
        try:
            attempts.add(json.loads((Path(job_dir) / name).read_text(encoding="utf-8"))["report"].get("attempt"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    return attempts
