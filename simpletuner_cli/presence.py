"""What a server process runs beside daphne: its presence beacon and, without a broker, the sweeps."""

import os
import socket


def start_presence_beacon():
    """Record this server process's presence now and every few seconds (see ``ServerPresence``).

    The heartbeat sweep, wherever it runs, takes workers offline only while some server was up to hear
    them; a server that stops or dies stops writing, and its silence is the signal.
    """
    import functools

    from django.utils import timezone

    from simpletuner_site.scheduler import EmbeddedScheduler
    from workers.presence import presence_interval, server_presence_beat
    from workers.streams import server_process_id

    hostname, pid = socket.gethostname(), os.getpid()
    beat = functools.partial(
        server_presence_beat,
        process_id=server_process_id(),  # the id its streams are recorded under
        hostname=hostname,
        pid=pid,
        started_at=timezone.now(),
    )
    beacon = EmbeddedScheduler(schedule=[("server presence", beat, presence_interval())])
    beacon.run_once("server presence", beat)
    return beacon.start()


def end_presence():
    """Mark this server process stopped (best effort: a failure is logged, the shutdown goes on)."""
    import logging

    from django.db import DatabaseError, connections

    from workers.presence import server_presence_end
    from workers.streams import server_process_id

    try:
        server_presence_end(process_id=server_process_id())
    except DatabaseError as exc:
        logging.getLogger(__name__).warning("could not record this server's stop: %s", exc)
    finally:
        connections.close_all()


def start_embedded_sweeps(settings):
    """Start the sweeps in this process and return their scheduler; None when Celery beat runs them (REDIS_URL)."""
    if settings.REDIS_URL:
        return None
    # Embedded mode: no broker, so the sweeps Celery beat would run are run in-process instead.
    from simpletuner_site.scheduler import EmbeddedScheduler

    scheduler = EmbeddedScheduler().start()
    print("Sweeps: embedded scheduler (no REDIS_URL); with Redis run Celery beat instead", flush=True)
    return scheduler
