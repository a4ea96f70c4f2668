"""Set-based sweeps over the fleet; the same functions run under Celery beat and the embedded scheduler."""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, Min
from django.utils import timezone

from audit import actions
from audit.services import Actor, audit_events, audit_write
from job_queue.models import AttemptOutcome, Job, JobAttempt, JobStatus
from simpletuner_site import metrics

from . import events
from .models import WORKER_TRANSITIONS, ServerPresence, Token, Worker, WorkerStatus, WorkerType
from .services import presence_interval

logger = logging.getLogger(__name__)

HEALTH = Actor.system("health-sweep")
CLEANUP = Actor.system("ephemeral-cleanup")
EPHEMERAL_CLEANUP_REASON = "ephemeral cleanup"


def servers_silent_reason(*, now, timeout):
    """Return why workers' silence proves nothing right now (no server was up to hear them), or None.

    Servers record their presence (``ServerPresence``); with no record at all (servers that do not
    record it, unit tests) silence counts as before. Otherwise it counts only while a server is alive
    and some live server has been up for the whole heartbeat timeout.
    """
    live_after = now - timedelta(seconds=1.5 * presence_interval())
    up_since = ServerPresence.objects.filter(last_seen__gte=live_after).aggregate(up_since=Min("started_at"))["up_since"]
    if up_since is None:
        if ServerPresence.objects.exists():
            return "no orchestrator server is up to receive heartbeats"
        return None
    if up_since > now - timedelta(seconds=timeout):
        return f"the orchestrator servers have been up only {(now - up_since).total_seconds():.0f} s"
    return None


def sweep_stale_workers(*, now=None, actor=HEALTH):
    """Take workers silent for longer than the heartbeat timeout offline and recover their jobs.

    A job they held that was never acknowledged goes back to the queue without spending a retry; a
    running one is requeued while retries remain, else failed with the reason. Runs a fixed number
    of queries whatever the fleet size; rows locked by a concurrent request or sweep are skipped and
    picked up by the next run. Return ``{"workers": n, "requeued": n, "failed": n}``.
    """
    now = now or timezone.now()
    timeout = settings.SIMPLETUNER["HEARTBEAT_TIMEOUT"]
    cutoff = now - timedelta(seconds=timeout)
    going_offline = WORKER_TRANSITIONS[WorkerStatus.OFFLINE]
    reason = f"no heartbeat for {timeout:g} s"
    silent = servers_silent_reason(now=now, timeout=timeout)
    if silent:
        logger.warning("health sweep: no worker taken offline: %s (their heartbeats had nowhere to go)", silent)
        return {"workers": 0, "requeued": 0, "failed": 0}
    with transaction.atomic():
        stale = list(
            Worker.objects.select_for_update(skip_locked=True)
            .filter(status__in=going_offline, last_heartbeat__lt=cutoff)
            .order_by()  # the model's ordering (name) would make SQLite walk the name index, not worker_status_hb
            .values_list("pk", "status")
        )
        if not stale:
            return {"workers": 0, "requeued": 0, "failed": 0}
        worker_ids = [pk for pk, _ in stale]
        jobs = list(
            Job.objects.select_for_update(skip_locked=True)
            .filter(worker_id__in=worker_ids, status__in=[JobStatus.DISPATCHED, JobStatus.RUNNING])
            .order_by()
            .values_list("pk", "status", "worker_id", "lease_id", "retry_count", "max_retries", "attempt_count")
        )
        # A worker whose job another transaction holds right now (a cancel, the ack sweep) waits for the
        # next run: taking it offline now would clear its current job and leave that job orphaned.
        held_elsewhere = set(
            Job.objects.filter(worker_id__in=worker_ids, status__in=[JobStatus.DISPATCHED, JobStatus.RUNNING])
            .exclude(pk__in=[j[0] for j in jobs])
            .order_by()
            .values_list("worker_id", flat=True)
        )
        if held_elsewhere:
            stale = [(pk, status) for pk, status in stale if pk not in held_elsewhere]
            worker_ids = [pk for pk, _ in stale]
            if not stale:
                return {"workers": 0, "requeued": 0, "failed": 0}
        unacked = [j for j in jobs if j[1] == JobStatus.DISPATCHED]
        retry = [j for j in jobs if j[1] == JobStatus.RUNNING and j[4] < j[5]]
        exhausted = [j for j in jobs if j[1] == JobStatus.RUNNING and j[4] >= j[5]]
        back_to_queue = {"worker": None, "lease_id": None, "dispatched_at": None, "started_at": None}

        Worker.objects.filter(pk__in=worker_ids, status__in=going_offline).update(
            status=WorkerStatus.OFFLINE, current_job=None, status_changed_at=now
        )
        Job.objects.filter(pk__in=[j[0] for j in unacked], status=JobStatus.DISPATCHED).update(
            status=JobStatus.QUEUED, last_error=f"worker lost before acknowledging: {reason}", **back_to_queue
        )
        Job.objects.filter(pk__in=[j[0] for j in retry], status=JobStatus.RUNNING).update(
            status=JobStatus.QUEUED, retry_count=F("retry_count") + 1, last_error=f"worker lost: {reason}", **back_to_queue
        )
        Job.objects.filter(pk__in=[j[0] for j in exhausted], status=JobStatus.RUNNING).update(
            status=JobStatus.FAILED,
            finished_at=now,
            last_error=f"worker lost: {reason}; retries exhausted",
        )
        JobAttempt.objects.filter(lease_id__in=[j[3] for j in unacked], outcome="").update(
            outcome=AttemptOutcome.UNACKNOWLEDGED, error=reason, finished_at=now
        )
        JobAttempt.objects.filter(lease_id__in=[j[3] for j in retry + exhausted], outcome="").update(
            outcome=AttemptOutcome.LOST, error=reason, finished_at=now
        )

        audit = audit_events(
            actor=actor,
            action=actions.WORKER_STATUS_CHANGED,
            target_type="worker",
            rows=[(pk, {"from": status, "to": WorkerStatus.OFFLINE, "reason": reason}) for pk, status in stale],
        )
        for group, to, spent in ((unacked, JobStatus.QUEUED, False), (retry, JobStatus.QUEUED, True), (exhausted, JobStatus.FAILED, False)):
            audit += audit_events(
                actor=actor,
                action=actions.JOB_STATUS_CHANGED,
                target_type="job",
                rows=[
                    (j[0], {"from": j[1], "to": to, "reason": f"worker {j[2]} lost: {reason}", "attempt": j[6], "worker": j[2]})
                    for j in group
                ],
            )
            if to == JobStatus.QUEUED:
                audit += audit_events(
                    actor=actor,
                    action=actions.JOB_REQUEUED,
                    target_type="job",
                    rows=[
                        (j[0], {"reason": reason, "retry_spent": spent, "retry_count": j[4] + spent, "max_retries": j[5], "previous_worker": j[2]})
                        for j in group
                    ],
                )
        audit_write(audit)
        metrics.requeued_on_commit(len(unacked), retry_spent=False)
        metrics.requeued_on_commit(len(retry), retry_spent=True)
        metrics.retries_exhausted_on_commit(len(exhausted))

        if unacked or retry:
            from job_queue.services import dispatch_pending

            transaction.on_commit(dispatch_pending, robust=True)
    result = {"workers": len(stale), "requeued": len(unacked) + len(retry), "failed": len(exhausted)}
    logger.info("health sweep: %(workers)d worker(s) offline, %(requeued)d job(s) requeued, %(failed)d failed", result)
    return result


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
    with transaction.atomic():
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
            events.revoke_streams_on_commit(worker_id, token_ids, "worker deleted")
    result = {"workers": len(doomed)}
    logger.info("ephemeral cleanup: %(workers)d offline ephemeral worker(s) deleted", result)
    return result
