"""Reads about workers that need more than a filter."""

from datetime import timedelta

from django.db.models import BooleanField, Count, Exists, ExpressionWrapper, Min, Q

from .models import ServerPresence, WorkerStatus
from .presence import presence_interval


# What packing workers hold, ``{worker id: [its jobs on its GPUs, each with the gpu_indices it holds there]}`` for a
# list of worker ids: its packed jobs and its gang members. The rule lives in ``job_queue.packing.held_by``, above
# this app (which does not import job_queue); job_queue hands it here once the apps are ready (JobQueueConfig.ready).
HELD_BY = None


def held_jobs(worker):
    """The jobs on packing ``worker``'s GPUs, each with the ``gpu_indices`` it holds there (``HELD_BY``)."""
    return HELD_BY([worker.pk])[worker.pk]


def held_jobs_attach(workers):
    """Set ``held_jobs`` on each of ``workers`` that packs and is busy or draining (an idle or offline one holds none):
    one read for them all (``HELD_BY``); return ``workers``."""
    holding = [w for w in workers if w.packs and w.status in (WorkerStatus.BUSY, WorkerStatus.DRAINING)]
    held = HELD_BY([w.pk for w in holding]) if holding else {}
    for worker in workers:
        if worker.packs:
            worker.held_jobs = held.get(worker.pk, [])
    return workers


def servers_silent_reason(*, now, timeout):
    """Return why workers' silence for ``timeout`` seconds proves nothing right now, or None.

    Silence proves something only if a server was up to hear them. Servers record their presence
    (``ServerPresence``); with no record at all (servers that do not record it, unit tests) silence
    counts as before. Otherwise it counts only while a server is alive and some live server has been
    up for the whole ``timeout`` (the heartbeat timeout for the health sweep, the acknowledgement
    timeout for the dispatch-ack sweep).
    """
    live_after = _live_after(now)
    seen = ServerPresence.objects.aggregate(
        up_since=Min("started_at", filter=Q(last_seen__gte=live_after)), servers=Count("pk")
    )
    up_since = seen["up_since"]
    if up_since is None:
        return "no orchestrator server is up to hear the workers" if seen["servers"] else None
    if up_since > now - timedelta(seconds=timeout):
        return f"the orchestrator servers have been up only {(now - up_since).total_seconds():.0f} s"
    return None


def servers_heard_silence(*, now, timeout):
    """Return a boolean expression for a sweep's own query: true exactly when ``servers_silent_reason`` is None.

    That is: no server records its presence at all, or a live server has been up for the whole
    ``timeout``. A sweep reads it with the rows it found (``annotate``) instead of asking first, and
    asks ``servers_silent_reason`` why only when it has to hold them back.
    """
    up_all_along = ServerPresence.objects.filter(
        last_seen__gte=_live_after(now), started_at__lte=now - timedelta(seconds=timeout)
    )
    return ExpressionWrapper(~Exists(ServerPresence.objects.all()) | Exists(up_all_along), output_field=BooleanField())


def _live_after(now):
    """Return when a live server last recorded its presence at the latest."""
    return now - timedelta(seconds=1.5 * presence_interval())
