"""The job's progress as the jobs list and the job page show it: the bar (with the trainer's ETA and stage), and
the chart of step and loss over time, as inline SVG (no script, no external asset)."""

from django.utils.html import format_html
from django.utils.safestring import mark_safe

from worker_agent.progress import format_seconds, format_stage

from .models import JOB_TERMINAL, JobStatus

WIDTH, HEIGHT, PAD = 640, 180, 36


def _number(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _stage_html(progress):
    """Return the trainer's stage ("Saving Checkpoint: running (2/6)", its message on hover) as a line under the bar, or ""."""
    stage = progress.get("stage")
    if not isinstance(stage, dict) or not (stage.get("label") or stage.get("key")):
        return ""
    text = format_stage({name: str(stage[name]) for name in ("key", "label", "status") if stage.get(name)})
    current, total = _number(stage.get("current")), _number(stage.get("total"))
    if current is not None and total:
        text += f" ({current:g}/{total:g})"
    message = stage.get("message") if isinstance(stage.get("message"), str) else ""
    return format_html('<span class="st-progress-stage st-muted" style="display: block" title="{}">{}</span>', message, text)


def progress_bar_html(job):
    """Return ``job``'s progress as a bar with its percentage, step, loss, the trainer's ETA while it runs,
    and its stage under it; a dash when nothing is known."""
    progress = job.progress if isinstance(job.progress, dict) else {}
    fraction = progress.get("fraction")
    if job.status == JobStatus.COMPLETED:
        fraction = 1.0
    stage = _stage_html(progress)
    if _number(fraction) is None:
        return stage or format_html('<span class="st-muted">{}</span>', "—")
    fraction = min(max(float(fraction), 0.0), 1.0)
    parts = [f"{fraction:.0%}"]
    if progress.get("step") is not None and progress.get("total_steps"):
        parts.append(f"step {progress['step']}/{progress['total_steps']}")
    if _number(progress.get("loss")) is not None:
        parts.append(f"loss {progress['loss']:.4g}")
    eta = _number(progress.get("eta_seconds"))
    if eta is not None and eta >= 0 and job.status not in JOB_TERMINAL:
        parts.append(f"ETA {format_seconds(eta)}")
    state = {JobStatus.COMPLETED: " st-progress-done", JobStatus.FAILED: " st-progress-failed"}.get(job.status, "")
    return format_html(
        '<span class="st-progress{}" role="progressbar" aria-valuenow="{}" aria-valuemin="0" aria-valuemax="100">'
        '<span style="width: {}%"></span></span><span class="st-progress-text">{}</span>{}',
        state,
        round(fraction * 100),
        round(fraction * 100, 1),
        " · ".join(parts),
        stage,
    )


def progress_chart_html(samples):
    """Return an SVG chart of ``samples`` (``[seconds, step, loss]``): step in blue on the left axis, loss in
    orange on the right; or a muted note when there is nothing to draw."""
    points = [s for s in samples or () if isinstance(s, list) and len(s) == 3]
    if len(points) < 2:
        return format_html('<span class="st-muted">{}</span>', "not enough progress reported yet for a chart")
    times = [p[0] for p in points]
    t0, t1 = min(times), max(times)
    series = []
    for index, colour, side in ((1, "#417690", "left"), (2, "#e07b00", "right")):
        values = [(p[0], p[index]) for p in points if p[index] is not None]
        if len(values) < 2:
            continue
        low, high = min(v for _, v in values), max(v for _, v in values)
        coords = " ".join(f"{_x(t, t0, t1):.1f},{_y(v, low, high):.1f}" for t, v in values)
        series.append((colour, coords, side, _label(high), _label(low), "step" if index == 1 else "loss"))
    if not series:
        return format_html('<span class="st-muted">{}</span>', "no step or loss reported yet")
    lines = mark_safe("".join(  # each piece is format_html's output
        format_html('<polyline class="st-chart-{}" fill="none" stroke="{}" stroke-width="2" points="{}"/>', name, colour, coords)
        for colour, coords, _side, _hi, _lo, name in series
    ))
    labels = mark_safe("".join(
        format_html(
            '<text x="{}" y="{}" fill="{}" font-size="11" text-anchor="{}">{} {}</text>'
            '<text x="{}" y="{}" fill="{}" font-size="11" text-anchor="{}">{}</text>',
            4 if side == "left" else WIDTH - 4, PAD - 8, colour, "start" if side == "left" else "end", name, high,
            4 if side == "left" else WIDTH - 4, HEIGHT - PAD + 14, colour, "start" if side == "left" else "end", low,
        )
        for colour, _coords, side, high, low, name in series
    ))
    return format_html(
        '<svg class="st-progress-chart" id="progress-chart" role="img" aria-label="step and loss over time" '
        'viewBox="0 0 {w} {h}" width="{w}" height="{h}">'
        '<rect x="{p}" y="{p}" width="{iw}" height="{ih}" fill="none" stroke="#ccc"/>{}{}'
        '<text x="{p}" y="{h}" font-size="11" fill="#666">0 s</text>'
        '<text x="{r}" y="{h}" font-size="11" fill="#666" text-anchor="end">{end} s</text></svg>',
        lines,
        labels,
        w=WIDTH, h=HEIGHT - 2, p=PAD, iw=WIDTH - 2 * PAD, ih=HEIGHT - 2 * PAD, r=WIDTH - PAD, end=_label(t1 - t0),
    )


def _x(t, t0, t1):
    return PAD + (t - t0) / ((t1 - t0) or 1) * (WIDTH - 2 * PAD)


def _y(v, low, high):
    return HEIGHT - PAD - (v - low) / ((high - low) or 1) * (HEIGHT - 2 * PAD)


def _label(value):
    return f"{value:.4g}" if isinstance(value, float) else str(value)
