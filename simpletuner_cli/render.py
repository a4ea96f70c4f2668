"""How the user commands print: tables that fit the terminal, a job's lines, its progress bar."""

import json
import math
import shutil
from datetime import datetime, timezone

TERMINAL_STATUSES = ("completed", "failed", "cancelled")
# A job's end -> the exit status of `jobs watch` / `submit --follow`.
EXIT_FOR_STATUS = {"completed": 0, "failed": 1, "cancelled": 2}
BAR_WIDTH = 24


def terminal_width(default=100):
    """Return the terminal's width in columns (``default`` when stdout is not one and COLUMNS is unset)."""
    return shutil.get_terminal_size((default, 24)).columns


def clip(text, width):
    """Return ``text`` cut to ``width`` characters, ending in an ellipsis when cut."""
    text = str(text)
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: max(width - 1, 0)] + "…"


def table(rows, columns, *, width=None):
    """Return ``rows`` (dicts) as a text table of ``columns`` (``(header, key or callable, minimum width)``, None: never
    cut) that fits ``width`` columns: the widest columns give way first, never below their minimum; past that,
    columns are dropped from the right."""
    width = width or terminal_width()
    cells = [[_cell(row, key) for _, key, _ in columns] for row in rows]
    headers = [header for header, _, _ in columns]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    minimums = [min(w, minimum) if minimum is not None else w for w, (_, _, minimum) in zip(widths, columns)]
    while len(widths) > 1 and sum(minimums[: len(widths)]) + 2 * (len(widths) - 1) > width:
        widths.pop()
    shown = len(widths)
    while sum(widths) + 2 * (shown - 1) > width:
        widest = max(range(shown), key=lambda i: widths[i] - minimums[i])
        if widths[widest] <= minimums[widest]:
            break
        widths[widest] -= 1
    lines = ["  ".join(clip(h, w).ljust(w) for h, w in zip(headers, widths)).rstrip()]
    for row in cells:
        lines.append("  ".join(clip(c, w).ljust(w) for c, w in zip(row[:shown], widths)).rstrip())
    return "\n".join(lines)


def _cell(row, key):
    value = key(row) if callable(key) else row.get(key)
    if value is None or value == "":
        return "-"
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items()) or "-"
    return " ".join(str(value).split())


def as_json(value):
    """Return ``value`` as the API's JSON, indented."""
    return json.dumps(value, indent=2, ensure_ascii=False)


def when(stamp):
    """Return an API time stamp as ``YYYY-MM-DD HH:MM`` in UTC, or ``-``."""
    if not stamp:
        return "-"
    try:
        moment = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    except ValueError:
        return stamp
    return moment.astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M")


def progress_of(job):
    """Return ``(step, total, loss, fraction)`` from a job's progress (None where it does not say)."""
    progress = job.get("progress") or {}
    if not isinstance(progress, dict):
        return None, None, None, None
    step = _number(progress.get("step"))
    total = _number(progress.get("total_steps") or progress.get("total"))
    loss = _number(progress.get("loss"))
    fraction = _number(progress.get("fraction"))
    if fraction is None and step is not None and total:
        fraction = min(step / total, 1.0)
    return step, total, loss, fraction


def _number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value


def progress_cell(job):
    """The jobs table's progress: ``step/total`` or a percentage."""
    step, total, _, fraction = progress_of(job)
    if step is not None and total:
        return f"{int(step)}/{int(total)}"
    return f"{fraction:.0%}" if fraction is not None else ""


JOB_COLUMNS = [
    ("ID", "id", None),
    ("STATUS", "status", 9),
    ("CONFIG", lambda j: j["config_name"] + (f"@{j['config_version']}" if j.get("config_version") else ""), 8),
    ("PROGRESS", progress_cell, 8),
    ("WORKER", "worker_name", 6),
    ("SUBMITTED", lambda j: when(j.get("submitted_at")), 10),
    ("BY", "submitted_by", 4),
    ("TEAM", "team", 4),
    ("WAITING", "waiting_reason", 10),
    ("PLACE", "queue_position", 5),
]

WORKER_COLUMNS = [
    ("ID", "id", None),
    ("NAME", "name", None),
    ("STATUS", "status", 7),
    ("TYPE", "worker_type", 6),
    ("GPUS", lambda w: f"{w.get('gpu_count') or 0} {w.get('gpu_name') or ''}".strip(), 4),
    ("JOB", "current_job_id", 6),
    ("LABELS", "labels", 8),
    ("HEARTBEAT", lambda w: when(w.get("last_heartbeat")), 10),
]

CONFIG_COLUMNS = [
    ("NAME", "name", None),
    ("VERSION", "version", 7),
    ("OWNER", "owner", 5),
    ("CREATED", lambda c: when(c.get("created_at")), 10),
    ("DESCRIPTION", "description", 11),
]


def job_details(job):
    """Return the lines of `jobs show`: the job's fields that matter, its attempts and artifacts."""
    step, total, loss, fraction = progress_of(job)
    lines = [
        f"Job        {job['id']}",
        f"Status     {job['status']}" + (f" ({job['waiting_reason']})" if job.get("waiting_reason") else ""),
        *([f"Place      {job['queue_position']} in the queue"] if job.get("queue_position") else []),
        f"Config     {job['config_name']}" + (f" version {job['config_version']}" if job.get("config_version") else ""),
        f"Target     {job.get('target')}  GPUs {job.get('gpu_count') or 'any'}  priority {job.get('priority')}",
        f"Labels     {_cell(job, 'worker_labels')}",
        f"Worker     {job.get('worker_name') or '-'}",
        f"Progress   {progress_line(job) if (step is not None or fraction is not None) else '-'}",
        f"Submitted  {when(job.get('submitted_at'))} by {job.get('submitted_by') or '-'}"
        + (f" for team {job['team']}" if job.get("team") else ""),
        f"Finished   {when(job.get('finished_at'))}",
    ]
    if job.get("last_error"):
        lines.append(f"Error      {job['last_error']}")
    if job.get("retry_of"):
        lines.append(f"Retry of   {job['retry_of']}")
    if (job.get("num_nodes") or 1) > 1:
        lines.append(f"Nodes      {job['num_nodes']}  port {job.get('master_port') or '-'}")
    for member in job.get("members") or []:
        lines.append(
            f"Rank {member['rank']}     {member.get('worker_name') or '-'}  {member.get('outcome') or 'running'}"
            + ("" if member.get("acknowledged") else " (not acknowledged)")
        )
    for attempt in job.get("attempts") or []:
        lines.append(
            f"Attempt {attempt['number']}  {attempt.get('worker_name') or '-'}  {attempt.get('outcome') or 'in progress'}"
            + (f": {attempt['error']}" if attempt.get("error") else "")
        )
    for artifact in job.get("artifacts") or []:
        lines.append(f"Artifact   {artifact['key']}  {human_bytes(artifact['size'])}  sha256 {artifact['sha256'][:16]}…")
    return lines


def human_bytes(size):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"


def progress_line(job):
    """The plain line of a job's progress: ``step 120/500 loss 0.031`` (or a percentage without steps)."""
    step, total, loss, fraction = progress_of(job)
    parts = []
    if step is not None:
        parts.append(f"step {int(step)}" + (f"/{int(total)}" if total else ""))
    elif fraction is not None:
        parts.append(f"{fraction:.0%}")
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    return " ".join(parts)


def format_eta(seconds):
    """Return a duration as ``1h02m``, ``3m05s`` or ``12s``."""
    seconds = max(int(round(seconds)), 0)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


class EtaEstimator:
    """Estimates the time left from the steps seen so far and when (``now`` in seconds)."""

    def __init__(self):
        self.first = None

    def eta(self, step, total, now):
        if step is None or not total:
            return None
        if self.first is None or step < self.first[0]:
            self.first = (step, now)
            return None
        done, elapsed = step - self.first[0], now - self.first[1]
        if done <= 0 or elapsed <= 0:
            return None
        return (total - step) * elapsed / done


def progress_bar(job, *, eta=None, width=None):
    """The live line on a terminal: ``[#######.....]  120/500  24%  loss 0.031  ETA 1m05s``, fitting ``width``."""
    step, total, loss, fraction = progress_of(job)
    fraction = fraction or 0.0
    filled = int(round(fraction * BAR_WIDTH))
    parts = ["[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"]
    if step is not None:
        parts.append(f"{int(step)}/{int(total)}" if total else f"step {int(step)}")
    parts.append(f"{fraction:.0%}")
    if loss is not None:
        parts.append(f"loss {loss:.4g}")
    if eta is not None:
        parts.append(f"ETA {format_eta(eta)}")
    return clip("  ".join(parts), (width or terminal_width()) - 1)


def status_line(job):
    """The line said on a change of state: ``running on gpu-1``, ``queued: no worker has >= 8 GPUs``..."""
    status = job["status"]
    if status == "queued" and job.get("waiting_reason"):
        return f"queued: {job['waiting_reason']}"
    if status in ("dispatched", "running") and job.get("worker_name"):
        return f"{status} on {job['worker_name']}"
    if status == "failed":
        return f"failed: {job.get('last_error') or 'no reason given'}"
    return status
