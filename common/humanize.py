"""Times as operators read them, shared by the admin and the management commands (and mirrored in live.js)."""

from django.utils import timezone


def ago(moment, now=None):
    """Return how long before ``now`` ``moment`` was, e.g. ``12 s ago``, ``5 min ago``, ``3 h ago``; or ``never``."""
    if moment is None:
        return "never"
    seconds = max(0, int(((now or timezone.now()) - moment).total_seconds()))
    if seconds < 120:
        return f"{seconds} s ago"
    if seconds < 120 * 60:
        return f"{seconds // 60} min ago"
    if seconds < 48 * 3600:
        return f"{seconds // 3600} h ago"
    return f"{seconds // 86400} d ago"
