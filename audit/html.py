"""The audit trail of one object as HTML, for the admin pages of the apps above."""

import json
from urllib.parse import urlencode

from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join

from .models import AuditEvent


def audit_trail_html(target_type, target_id, limit=50):
    """Return the newest audit rows about one worker or job as an HTML table (with a link to all of them)."""
    rows = list(AuditEvent.objects.filter(target_type=target_type, target_id=target_id)[:limit])
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
    everything = reverse("admin:audit_auditevent_changelist") + "?" + urlencode({"q": target_id})
    return format_html(
        '<table class="st-audit"><thead><tr><th>When</th><th>Action</th><th>By</th><th>OK</th><th>Details</th>'
        '</tr></thead><tbody>{}</tbody></table><p><a href="{}">All audit rows for {}</a></p>',
        body,
        everything,
        target_id,
    )


def _short_json(value, limit=300):
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


