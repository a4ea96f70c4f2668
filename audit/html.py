"""The audit trail of one object as HTML, for the admin pages of the apps above."""

import json
from urllib.parse import urlencode

from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from .models import AuditEvent


def audit_trail_html(target_type, target_id, limit=5):
    """Return the newest ``limit`` audit rows about one worker or job as an HTML table, with a link to the
    audit list filtered to all of them (a job's page stays short however many rows it has)."""
    about = AuditEvent.objects.filter(target_type=target_type, target_id=target_id)
    rows = list(about[:limit])
    if not rows:
        return format_html('<span class="st-muted">{}</span>', "no audit rows")
    body = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td></tr>",
        (
            (
                f"{timezone.localtime(row.created_at):%Y-%m-%d %H:%M:%S}",
                row.action,
                f"{row.actor_type}:{row.actor_name or row.actor_id}",
                "yes" if row.success else "refused",
                _short_json(row.details),
            )
            for row in rows
        ),
    )
    total = len(rows) if len(rows) < limit else about.count()
    everything = reverse("admin:audit_auditevent_changelist") + "?" + urlencode({"q": target_id, "target_type": target_type})
    shown = f"the newest {len(rows)} of {total}" if total > len(rows) else f"all {total}"
    return format_html(
        '<table class="st-audit"><thead><tr><th>When</th><th>Action</th><th>By</th><th>OK</th><th>Details</th>'
        '</tr></thead><tbody>{}</tbody></table><p class="st-audit-more">Showing {}: '
        '<a href="{}">all {} audit rows for {}</a></p>',
        body,
        shown,
        everything,
        total,
        target_id,
    )


def _short_json(value, limit=300):
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


