"""Where a stream resumes: the Last-Event-ID a client sends (header or ``lastEventId``), checked before any stream opens."""

import re
from urllib.parse import unquote

from django_eventstream.utils import parse_last_event_id

# One event id as the library writes it: a whole number, at most what an event counter column holds.
_EVENT_NUMBER = re.compile(r"[0-9]{1,18}")


def requested_resume(request):
    """Return ``{channel: last id}`` from the request's Last-Event-ID (the header, else the last non-empty
    ``lastEventId`` parameter), ``{}`` without one; raise ValueError for a malformed one. Decided before
    the stream is marked open, so a refused request changes nothing."""
    return resume_from(request.headers.get("Last-Event-ID"), request.GET.getlist("lastEventId"))


def resume_from(header, parameters):
    """``requested_resume`` from the Last-Event-ID ``header`` (or None) and the ``lastEventId`` query ``parameters``.

    Each comma-separated part must be ``<channel>:<n>``: a channel that is not empty and a whole number
    (``worker-<id>:abc``, ``:1.5`` and ``:`` are refused), so no malformed id reaches the library's storage.
    """
    last_event_id = header or next((value for value in reversed(parameters) if value), "")
    if not last_event_id:
        return {}
    try:
        parsed = {unquote(channel): last_id for channel, last_id in parse_last_event_id(last_event_id).items()}
    except ValueError:
        parsed = None
    if not parsed or any(not channel or not _EVENT_NUMBER.fullmatch(last_id) for channel, last_id in parsed.items()):
        raise ValueError("Last-Event-ID must look like worker-<id>:<n>, <n> a whole number")
    return parsed
