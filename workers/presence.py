"""Server presence: which server processes are up to hear heartbeats (the sweeps hold back while none is)."""

from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from .models import ServerPresence

PRESENCE_KEEP = timedelta(days=7)


def presence_interval():
    """Return how often (seconds) a server writes its presence: at most every 10 s, and at least as
    often as agents heartbeat, so a dead server is noticed before a worker's silence counts."""
    return min(10.0, float(settings.SIMPLETUNER["HEARTBEAT_INTERVAL"]))


def server_presence_end(*, process_id):
    """Record that server process ``process_id`` has stopped: it no longer counts as up (so the sweeps hold
    back while no server is), and the streams it served count as closed when a worker's next stream opens."""
    ServerPresence.objects.filter(pk=process_id).update(last_seen=timezone.now() - PRESENCE_KEEP / 2)


def server_presence_beat(*, process_id, hostname, pid, started_at, now=None):
    """Record that server process ``process_id`` is up now; forget processes silent for a week."""
    now = now or timezone.now()
    updated = ServerPresence.objects.filter(pk=process_id).update(last_seen=now)
    if not updated:
        ServerPresence.objects.create(
            pk=process_id, hostname=hostname[:255], pid=pid, started_at=started_at, last_seen=now
        )
        ServerPresence.objects.filter(last_seen__lt=now - PRESENCE_KEEP).delete()
