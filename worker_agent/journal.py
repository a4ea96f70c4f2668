"""The outcome journal: a finished job's result on disk until the orchestrator has answered its report.

A trainer's result must outlive the agent that ran it (kill -9, a crash, a reboot): otherwise the job
runs again. The agent writes ``<job dir>/outcome.json`` before it reports the result, and renames it to
``outcome.reported.json`` once the orchestrator has answered the report (accepted or refused). At
start-up, before it registers, the agent reports every ``outcome.json`` still under its work dir.

The file holds ``job_id``, ``worker_id`` (the worker the job was dispatched to) and ``report``: the job
status report exactly as it is sent (``status``, ``attempt``, ``exit_code``, ``error``, ``progress``,
``log_tail``).

Each worker's job directories are its own: ``<work dir>/<worker id>/<job id>/``, so agents of several
workers may share one work dir (one agent per GPU on one host) and none reports another's result. The
worker's directory holds ``worker.json``: its id and the SHA-256 digests of the tokens its agents used,
so that an agent that starts before the orchestrator answers knows its worker (by its token) and
delivers that worker's results alone. Job directories straight under the work dir are an older agent's
(no worker id): their results are reported too, and left in place when the orchestrator says the job
is not this worker's (``protocol.JOB_NOT_OWNED``), for the agent whose job it was.

The agent can die in the instant between its trainer's end and that write. The trainer's supervisor
(supervisor.py) records every end in ``<job dir>/exit.json``, which the agent settles once it has
journaled (or decided not to report) the result; at start-up ``recover_exits`` turns each unsettled
record into an ``outcome.json`` by the same rule the agent applies to a trainer it watched end
(``runner.exit_report``), with the log tail and progress read back from ``train.log``.
"""

import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import NamedTuple

from . import runner, supervisor

logger = logging.getLogger("worker_agent")

OUTCOME_FILE = "outcome.json"  # written before the report; still there = not delivered yet
REPORTED_FILE = "outcome.reported.json"  # the same file once the orchestrator answered the report
WORKER_FILE = "worker.json"  # in a worker's directory: its id and the digests of its agents' tokens
FORMAT_VERSION = 1
TOKENS_KEPT = 16  # digests remembered per worker (one per token rotation)
_WORKER_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a worker id that is a safe directory name


class Journaled(NamedTuple):
    """A result found on disk, not delivered yet."""

    path: Path
    job_id: str
    report: dict


def token_digest(token):
    """Return the SHA-256 hex digest of ``token`` (what ``worker.json`` remembers; never the token)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def worker_dir(work_dir, worker_id):
    """Return ``<work_dir>/<worker_id>``: the directory of that worker's jobs. Raise ValueError for an id
    that is no plain directory name."""
    if not isinstance(worker_id, str) or not _WORKER_ID.fullmatch(worker_id):
        raise ValueError(f"unusable worker id {worker_id!r}")
    return Path(work_dir) / worker_id


def worker_of_token(work_dir, token):
    """Return the id of the worker whose directory under ``work_dir`` remembers ``token``, or None."""
    digest = token_digest(token)
    for path in sorted(Path(work_dir).glob(f"*/{WORKER_FILE}")) if Path(work_dir).is_dir() else ():
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            if digest in record["tokens"] and record["worker_id"] == path.parent.name:
                return record["worker_id"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("Ignoring an unreadable worker record %s: %s", path, exc)
    return None


def remember_worker(work_dir, worker_id, token):
    """Make ``worker_id``'s directory and remember ``token`` (its digest) as one of that worker's; return the
    directory. Raise OSError if it cannot be written, ValueError for an unusable worker id."""
    directory = worker_dir(work_dir, worker_id)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / WORKER_FILE
    try:
        tokens = list(json.loads(path.read_text(encoding="utf-8"))["tokens"])
    except (OSError, ValueError, KeyError, TypeError):
        tokens = []
    digest = token_digest(token)
    if digest not in tokens:
        tokens = [*tokens, digest][-TOKENS_KEPT:]
        supervisor.write_json_atomically(path, {"version": FORMAT_VERSION, "worker_id": worker_id, "tokens": tokens})
    return directory


def outcome_path(job_dir):
    return Path(job_dir) / OUTCOME_FILE


def write_outcome(job_dir, job_id, report, *, worker_id=None):
    """Write ``report`` for ``job_id`` (dispatched to ``worker_id``) to ``<job_dir>/outcome.json`` atomically
    and durably; return the path.

    A temp file is written and fsynced, renamed over the target, and the directory is fsynced, so the
    file is either absent or complete, whenever the agent dies. Raise OSError if it cannot be written.
    """
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    record = {"version": FORMAT_VERSION, "job_id": str(job_id), "written_at": time.time(), "report": dict(report)}
    if worker_id is not None:
        record["worker_id"] = str(worker_id)
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


def undelivered(jobs_dir, *, worker_id=None):
    """Return a ``Journaled`` for every ``outcome.json`` of the job dirs in ``jobs_dir``, oldest first.

    With ``worker_id``, a result recorded for another worker is left alone (logged, never returned). A
    file that cannot be read or parsed is logged and skipped (left in place for an operator).
    """
    jobs_dir = Path(jobs_dir)
    if not jobs_dir.is_dir():
        return []
    found = []
    for path in jobs_dir.glob(f"*/{OUTCOME_FILE}"):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
            report = record["report"]
            job_id = str(record.get("job_id") or path.parent.name)
            if not isinstance(report, dict) or not report.get("status"):
                raise ValueError("no report status")
            written = float(record.get("written_at") or 0)
            owner = record.get("worker_id")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("Ignoring an unreadable job outcome %s: %s", path, exc)
            continue
        if worker_id is not None and owner is not None and owner != worker_id:
            logger.info("Leaving the result of job %s to its own worker %s's agent (%s)", job_id, owner, path)
            continue
        found.append((written, str(path), Journaled(path, job_id, report)))
    found.sort(key=lambda item: (item[0], item[1]))
    return [entry for _, _, entry in found]


def recover_exits(work_dir, *, worker_id=None):
    """Journal the result of every trainer whose end no agent handled (an unsettled ``exit.json``) in the job
    dirs of ``work_dir`` (recorded for ``worker_id``, when known).

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
                write_outcome(job_dir, job_id, report, worker_id=worker_id)
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
