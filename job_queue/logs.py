"""Each job's whole log: the output lines its attempts' agents send (``protocol.LogLines``), kept once each,
bounded per attempt (``SIMPLETUNER_JOB_LOG_MAX_CHARS``, the oldest characters go first), and read back
as one text that states what was cut or never arrived."""

from django.conf import settings
from django.utils import timezone

from common.errors import NotFound
from worker_agent import protocol

from workers.models import Worker

from .models import JOB_TERMINAL, JobAttempt


def log_limit():
    """Return how many characters of each attempt's output are kept."""
    return settings.SIMPLETUNER["JOB_LOG_MAX_CHARS"]


def attempt_append_log(*, lease_id, chunk):
    """Append the lines of ``chunk`` (``protocol.LogLines``, already cleaned) that attempt ``lease_id`` lacks.

    A line it holds already (a report sent again) is skipped; lines numbered past what it holds were lost
    on the way (the agent's memory overflowed) and are counted as missing, with a marker in the text.
    The caller holds the job's lock, so one attempt is never appended to twice at once.
    """
    if not lease_id or not chunk:
        return
    start, lines = chunk[protocol.LOG_LINES_FROM], chunk["lines"]
    attempt = JobAttempt.objects.filter(lease_id=lease_id).only("pk", "log", "log_lines", "log_dropped_chars", "log_missing_lines").first()
    if attempt is None or start + len(lines) <= attempt.log_lines:
        return
    text, have, missing = attempt.log, attempt.log_lines, attempt.log_missing_lines
    if start > have:
        text += f"[… {start - have} line(s) of output never reached the orchestrator …]\n"
        missing += start - have
        have = start
    new = lines[have - start :]
    text += "".join(f"{line}\n" for line in new)
    have += len(new)
    dropped = attempt.log_dropped_chars
    limit = log_limit()
    if len(text) > limit:
        cut = len(text) - limit
        newline = text.find("\n", cut - 1)  # the line that starts at or after cut is kept whole
        cut = newline + 1 if newline != -1 else cut  # whole lines go
        text, dropped = text[cut:], dropped + cut
    JobAttempt.objects.filter(pk=attempt.pk).update(
        log=text, log_lines=have, log_dropped_chars=dropped, log_missing_lines=missing
    )


def job_full_log(job):
    """Return ``job``'s whole log as text: each attempt's output under a header naming it, with what was cut."""
    attempts = list(job.attempts.order_by("number"))
    if not attempts:
        return f"# job {job.pk} ({job.config_name}): no attempt yet, so no output\n"
    limit = log_limit()
    parts = [f"# job {job.pk} ({job.config_name}), {job.status}; log as of {timezone.now():%Y-%m-%d %H:%M:%S %Z}\n"]
    for attempt in attempts:
        parts.append(
            f"\n# --- attempt {attempt.number} on {attempt.worker_name or 'a deleted worker'}"
            f" ({attempt.outcome or 'in progress'}): {attempt.log_lines} line(s) ---\n"
        )
        if attempt.log_dropped_chars:
            parts.append(
                f"# [the first {attempt.log_dropped_chars} characters of this attempt's output were dropped: "
                f"each attempt keeps its last {limit} (SIMPLETUNER_JOB_LOG_MAX_CHARS)]\n"
            )
        if attempt.log_missing_lines:
            parts.append(f"# [{attempt.log_missing_lines} line(s) never reached the orchestrator]\n")
        parts.append(attempt.log or "# (no output received)\n")
    return "".join(parts)


def attempt_log_chunk(job, *, number, offset):
    """Return attempt ``number`` of ``job``'s output from character ``offset`` on (counted from the attempt's first
    character, those cut included), as ``{"job_id", "job_status", "attempts", "attempt", "outcome", "offset",
    "next_offset", "skipped", "text"}``: ``skipped`` characters from ``offset`` on were cut before this read, and
    ``next_offset`` is where the next read starts; ``stopping``: a worker still runs the job though it has ended (a
    cancel not yet confirmed), so more of its output may come. Raise NotFound for an attempt the job lacks."""
    attempt = job.attempts.filter(number=number).first()
    if attempt is None:
        raise NotFound(f"job {job.pk} has no attempt {number}")
    start = max(offset, attempt.log_dropped_chars)
    end = attempt.log_dropped_chars + len(attempt.log)
    return {
        "job_id": job.pk,
        "job_status": job.status,
        "attempts": job.attempt_count,
        "attempt": attempt.number,
        "outcome": attempt.outcome or None,
        "offset": min(start, end),
        "next_offset": max(end, offset),
        "skipped": max(0, min(start, end) - offset),
        "text": attempt.log[start - attempt.log_dropped_chars :] if start < end else "",
        "stopping": job.status in JOB_TERMINAL and Worker.objects.filter(current_job_id=job.pk).exists(),
    }
