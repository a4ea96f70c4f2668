"""The outcome journal: a finished job's result on disk until the orchestrator has answered its report.

A trainer's result must outlive the agent that ran it (kill -9, a crash, a reboot): otherwise the job
runs again. The agent writes ``<job dir>/outcome.json`` before it reports the result, and renames it to
``outcome.reported.json`` once the orchestrator has answered the report (accepted or refused). At
start-up, before it registers, the agent reports every ``outcome.json`` still under its work dir.

The file holds ``job_id`` and ``report``: the job status report exactly as it is sent (``status``,
``attempt``, ``exit_code``, ``error``, ``progress``, ``log_tail``).
"""

import json
import logging
import os
import time
from pathlib import Path

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
    path = job_dir / OUTCOME_FILE
    record = {"version": FORMAT_VERSION, "job_id": str(job_id), "written_at": time.time(), "report": dict(report)}
    tmp = job_dir / f".{OUTCOME_FILE}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(record, fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    _fsync_dir(job_dir)
    return path


def mark_delivered(path):
    """Rename ``outcome.json`` to ``outcome.reported.json`` (the orchestrator answered); never raise."""
    path = Path(path)
    try:
        os.replace(path, path.with_name(REPORTED_FILE))
        _fsync_dir(path.parent)
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


def _fsync_dir(directory):
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
