"""GPU usage for people: GET /api/usage (rows by user, team or config), the same as CSV, and a weekly bar chart.
The figures are ``job_queue.usage``'s, read from the attempts."""

import csv
import io
import re
from datetime import timezone as dt_timezone

from django.utils import timezone
from django.utils.dateparse import parse_datetime
from django.utils.html import format_html, format_html_join
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from common.errors import InvalidInput
from common.http import error_responses, query_param
from common.permissions import may
from job_queue.usage import GROUPS, QUOTA_WINDOW, usage_rows
from tenancy import permissions

RFC3339 = re.compile(r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)")
DEFAULT_WINDOW = QUOTA_WINDOW
CSV_COLUMNS = ("key", "gpu_seconds", "gpu_hours", "jobs", "attempts")


def _moment(params, name):
    text = params.get(name) or None
    moment = None
    if text is not None and RFC3339.fullmatch(text):
        try:
            moment = parse_datetime(text.upper())
        except (ValueError, OverflowError):  # no such date (2024-02-30)
            moment = None
    if text is not None and moment is None:
        raise InvalidInput(f"{name} must be an RFC 3339 date-time, e.g. 2026-01-31T12:00:00Z", code="invalid_filter")
    return moment.astimezone(dt_timezone.utc) if moment else None


def usage_query(params, user, *, now=None):
    """Return ``(group_by, since, until, submitted_by)`` from query parameters ``params`` (a mapping) for ``user``:
    by default by user over the last 30 days; ``submitted_by`` is the user themself unless they may read
    everyone's usage. Raise InvalidInput (``invalid_filter``) naming a bad parameter."""
    group_by = params.get("group_by") or "user"
    if group_by not in GROUPS:
        raise InvalidInput(f"group_by must be one of {', '.join(GROUPS)}", code="invalid_filter")
    until = _moment(params, "until") or (now or timezone.now())
    since = _moment(params, "since") or until - DEFAULT_WINDOW
    if since >= until:
        raise InvalidInput("since must be before until", code="invalid_filter")
    submitted_by = None if may(user, permissions.VIEW_ALL_USAGE) else user
    return group_by, since, until, submitted_by


def usage_csv(rows):
    """Return ``rows`` (``usage_rows``) as CSV text with a header."""
    out = io.StringIO()
    writer = csv.writer(out)
    writer.writerow(CSV_COLUMNS)
    for row in rows:
        key = row["key"] if row["key"] is not None else ""
        if key[:1] in ("=", "+", "-", "@"):
            key = "'" + key  # a spreadsheet would run it as a formula
        writer.writerow([key, f"{row['gpu_seconds']:.3f}", f"{row['gpu_seconds'] / 3600:.4f}", row["jobs"], row["attempts"]])
    return out.getvalue()


def weekly_chart_html(weeks, *, width=640, height=180, pad=30):
    """Return ``weeks`` (``[(week start, gpu_seconds)]``) as an SVG bar chart of GPU-hours, or a muted note."""
    if not weeks:
        return format_html('<span class="st-muted">{}</span>', "no weeks in this range")
    top = max(seconds for _, seconds in weeks) / 3600 or 1.0
    step = (width - 2 * pad) / len(weeks)
    def bar(i, start, seconds):
        tall = (seconds / 3600) / top * (height - 2 * pad)
        return tuple(
            f"{n:.1f}" for n in (pad + i * step + step * 0.1, height - pad - tall, step * 0.8, tall)
        ) + (start.date().isoformat(), f"{seconds / 3600:.2f}", f"{pad + i * step + step / 2:.1f}", height - pad + 14, start.strftime("%m-%d"))

    bars = format_html_join(
        "",
        '<rect class="st-usage-bar" x="{}" y="{}" width="{}" height="{}" fill="#417690">'
        "<title>week of {}: {} GPU-hours</title></rect>"
        '<text x="{}" y="{}" font-size="10" fill="#666" text-anchor="middle">{}</text>',
        (bar(i, start, seconds) for i, (start, seconds) in enumerate(weeks)),
    )
    return format_html(
        '<svg id="usage-chart" role="img" aria-label="GPU-hours by week" viewBox="0 0 {w} {h}" width="{w}" height="{h}">'
        '<line x1="{p}" y1="{b}" x2="{r}" y2="{b}" stroke="#ccc"/>{}'
        '<text x="{p}" y="{t}" font-size="11" fill="#666">{} GPU-h</text></svg>',
        bars,
        f"{top:.4g}",
        w=width, h=height, p=pad, r=width - pad, b=height - pad, t=pad - 8,
    )


class UsageView(APIView):
    operator_permissions = {"GET": permissions.VIEW_USAGE}

    @extend_schema(
        tags=["usage"],
        summary="GPU usage by user, team or config (GPU-seconds charged to each attempt from its acknowledgement to its end)",
        parameters=[
            OpenApiParameter("group_by", {"type": "string", "enum": list(GROUPS)}, description="Default: user."),
            OpenApiParameter("since", {"type": "string", "format": "date-time"}, description="RFC 3339; default: until - 30 days."),
            OpenApiParameter("until", {"type": "string", "format": "date-time"}, description="RFC 3339, exclusive; default: now."),
        ],
        responses={200: dict, **error_responses(400, 401, 403)},
    )
    def get(self, request):
        params = {name: query_param(request, name, typed=name != "group_by") for name in ("group_by", "since", "until")}
        group_by, since, until, submitted_by = usage_query(params, request.user)
        rows = usage_rows(group_by=group_by, since=since, until=until, submitted_by=submitted_by)
        return Response(
            {"rows": rows, "group_by": group_by, "since": since.isoformat(), "until": until.isoformat(), "only_mine": submitted_by is not None}
        )


