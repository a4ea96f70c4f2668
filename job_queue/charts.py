"""The job page's progress chart: step and loss over time, as inline SVG (no script, no external asset)."""

from django.utils.html import format_html
from django.utils.safestring import mark_safe

WIDTH, HEIGHT, PAD = 640, 180, 36


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
