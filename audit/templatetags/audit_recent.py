"""``{% recent_audit_rows 10 as rows %}``: the newest audit rows, for the admin index's "Recent actions"."""

from django import template

from ..admin import target_html
from ..models import AuditEvent

register = template.Library()


@register.simple_tag(takes_context=True)
def recent_audit_rows(context, limit=10):
    """Return the newest ``limit`` audit rows as ``(row, target html)``, or None if the signed-in user may not
    read the audit log."""
    user = context["request"].user
    if not user.has_perm("audit.view_auditevent"):
        return None
    return [(row, target_html(row)) for row in AuditEvent.objects.all()[:limit]]
