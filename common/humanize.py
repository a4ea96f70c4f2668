"""Times as operators read them, shared by the admin and the management commands (and mirrored in live.js)."""

from django.utils import timezone

from .inputs import format_controls_shown


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


_CONTROL = {c: f"\\x{c:02x}" for c in (*range(0x00, 0x20), 0x7F)} | {c: f"\\u{c:04x}" for c in range(0x80, 0xA0)}


def printable(text):
    """Return ``text`` with its control characters (C0, DEL, C1: terminal escapes among them) written as
    ``\\xNN`` / ``\\uNNNN``, and its format controls (bidi overrides, zero-width characters) as ``\\uNNNN``
    (``common.inputs.format_controls_shown``), for a terminal: a worker's name, labels or GPU name must not
    drive the operator's screen or reorder what it shows."""
    return format_controls_shown(str(text).translate(_CONTROL))
