"""The sweep of retired ephemeral workers; it runs under Celery beat and the embedded scheduler alike.

The stale-worker sweep recovers jobs too, so it lives with them (``job_queue.sweeps``).
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.utils import timezone

from audit import actions
from audit.services import Actor, audit_events, audit_write, audited_atomic
from worker_agent import protocol

from . import events
from .models import Token, Worker, WorkerStatus, WorkerType

logger = logging.getLogger(__name__)

CLEANUP = Actor.system("ephemeral-cleanup")
EPHEMERAL_CLEANUP_REASON = "ephemeral cleanup"


def sweep_offline_ephemeral_workers(*, now=None, actor=CLEANUP):
    """Delete ephemeral workers offline for longer than ``EPHEMERAL_CLEANUP_AFTER``, with their tokens.

    Their audit trail stays, and so does their job history: jobs and attempts keep ``worker_name``
    and lose only the link. A worker still holding a job is kept. Each deletion is audited
    (``worker.deleted``, reason "ephemeral cleanup"). Runs a fixed number of queries whatever the
    number of workers; a worker row locked by a concurrent request (its agent coming back) is
    skipped. Return ``{"workers": n}``.
    """
    now = now or timezone.now()
    after = settings.SIMPLETUNER["EPHEMERAL_CLEANUP_AFTER"]
    cutoff = now - timedelta(seconds=after)
    with audited_atomic():
        doomed = list(
            Worker.objects.select_for_update(skip_locked=True)
            .filter(worker_type=WorkerType.EPHEMERAL, status=WorkerStatus.OFFLINE, status_changed_at__lt=cutoff)
            .order_by()
            .values_list("pk", "name", "labels", "status_changed_at", "stream_id", "current_job_id")
        )
        # Filtered here, not in SQL: "current_job IS NULL" would lead SQLite to its (useless) unique index.
        doomed = [w[:5] for w in doomed if w[5] is None]
        if not doomed:
            return {"workers": 0}
        ids = [w[0] for w in doomed]
        # A stream some process still believes open is closed once the worker is gone.
        with_stream = [w[0] for w in doomed if w[4] is not None]
        stream_tokens = {}
        for worker_id, token_id in Token.objects.filter(worker_id__in=with_stream).values_list("worker_id", "pk"):
            stream_tokens.setdefault(worker_id, []).append(token_id)
        audit_write(
            audit_events(
                actor=actor,
                action=actions.WORKER_DELETED,
                target_type="worker",
                rows=[
                    (
                        pk,
                        {
                            "name": name,
                            "worker_type": WorkerType.EPHEMERAL,
                            "labels": labels,
                            "reason": EPHEMERAL_CLEANUP_REASON,
                            "offline_since": offline_since.isoformat(),
                        },
                    )
                    for pk, name, labels, offline_since, _stream in doomed
                ],
            )
        )
        # on_delete does the rest: tokens go with the worker, jobs and attempts keep worker_name.
        Worker.objects.filter(pk__in=ids, status=WorkerStatus.OFFLINE).delete()
        for worker_id, token_ids in stream_tokens.items():
            events.revoke_streams_on_commit(worker_id, token_ids, "worker deleted", code=protocol.WORKER_DELETED)
    result = {"workers": len(doomed)}
    logger.info("ephemeral cleanup: %(workers)d offline ephemeral worker(s) deleted", result)
    return result
