"""Set-based sweeps over jobs; the same functions run under Celery beat and the embedded scheduler."""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit import actions
from audit.services import Actor, audit_events, audit_write
from simpletuner_site import metrics
from workers.models import WORKER_ONLINE, Worker, WorkerStatus

from .models import AttemptOutcome, Job, JobAttempt, JobStatus
from .services import dispatch_pending

logger = logging.getLogger(__name__)

ACK_SWEEP = Actor.system("dispatch-ack-sweep")


def sweep_unacknowledged_dispatches(*, now=None, actor=ACK_SWEEP):
    """Put back on the queue every job dispatched longer than the acknowledgement timeout ago and never acknowledged.

    An agent acknowledges a ``job_submit`` with ``starting`` within milliseconds and a reconnecting
    stream redelivers it, so such a dispatch was lost in transit: the job goes back to ``queued``
    without spending a retry, its attempt ends ``unacknowledged``, and the worker that held it is
    freed (busy -> idle, draining stays draining; an offline worker only loses its job). A late
    ``starting`` for the old attempt is then refused (409). Runs a fixed number of queries whatever
    the number of jobs; a job or worker row locked by a concurrent request or sweep is skipped and
    picked up by the next run. Queued jobs are dispatched once the transaction commits.
    Return ``{"jobs": n, "workers_freed": n}``.
    """
    now = now or timezone.now()
    timeout = settings.SIMPLETUNER["DISPATCH_ACK_TIMEOUT"]
    cutoff = now - timedelta(seconds=timeout)
    reason = f"dispatch not acknowledged within {timeout:g} s"
    with transaction.atomic():
        jobs = list(
            Job.objects.select_for_update(skip_locked=True)
            .filter(status=JobStatus.DISPATCHED, dispatched_at__lt=cutoff)
            .order_by()  # the model's ordering (-submitted_at) would make SQLite walk that index instead
            .values_list("pk", "worker_id", "lease_id", "attempt_count", "retry_count", "max_retries")
        )
        if not jobs:
            return {"jobs": 0, "workers_freed": 0}
        workers = {
            pk: (status, drain_requested_at, current_job_id)
            for pk, status, drain_requested_at, current_job_id in Worker.objects.select_for_update(skip_locked=True)
            .filter(pk__in={j[1] for j in jobs if j[1] is not None})
            .order_by()
            .values_list("pk", "status", "drain_requested_at", "current_job_id")
        }
        # A worker row locked elsewhere may be its agent acknowledging right now: leave its job to the next run.
        jobs = [j for j in jobs if j[1] is None or j[1] in workers]
        if not jobs:
            return {"jobs": 0, "workers_freed": 0}
        job_ids = [j[0] for j in jobs]

        # The worker that held each job, if it still does: what it becomes (as worker_resting_status).
        freed = {}  # worker id -> (status before, status after)
        for job_id, worker_id, *_ in jobs:
            if worker_id is None or workers[worker_id][2] != job_id:
                continue
            status, drain_requested_at, _ = workers[worker_id]
            if status in WORKER_ONLINE:
                after = WorkerStatus.DRAINING if drain_requested_at is not None else WorkerStatus.IDLE
            else:  # offline (or connecting): no session to return to, it only loses the job
                after = status
            freed[worker_id] = (status, after)

        Job.objects.filter(pk__in=job_ids, status=JobStatus.DISPATCHED).update(
            status=JobStatus.QUEUED,
            worker=None,
            lease_id=None,
            dispatched_at=None,
            started_at=None,
            last_error=reason,
        )
        JobAttempt.objects.filter(lease_id__in=[j[2] for j in jobs], outcome="").update(
            outcome=AttemptOutcome.UNACKNOWLEDGED, error=reason, finished_at=now
        )
        free = {"current_job": None, "last_job_finished_at": now}
        for to in (WorkerStatus.IDLE, WorkerStatus.DRAINING):
            moved = [pk for pk, (before, after) in freed.items() if after == to and before != to]
            if moved:
                Worker.objects.filter(pk__in=moved, current_job_id__in=job_ids).update(
                    status=to, status_changed_at=now, **free
                )
        kept = [pk for pk, (before, after) in freed.items() if before == after]
        if kept:
            Worker.objects.filter(pk__in=kept, current_job_id__in=job_ids).update(**free)

        audit = audit_events(
            actor=actor,
            action=actions.JOB_STATUS_CHANGED,
            target_type="job",
            rows=[
                (
                    job_id,
                    {"from": JobStatus.DISPATCHED, "to": JobStatus.QUEUED, "reason": reason, "attempt": attempt}
                    | ({"worker": worker_id} if worker_id else {}),
                )
                for job_id, worker_id, _lease, attempt, _retries, _max in jobs
            ],
        )
        audit += audit_events(
            actor=actor,
            action=actions.JOB_REQUEUED,
            target_type="job",
            rows=[
                (
                    job_id,
                    {
                        "reason": reason,
                        "retry_spent": False,
                        "retry_count": retries,
                        "max_retries": max_retries,
                        "previous_worker": worker_id,
                    },
                )
                for job_id, worker_id, _lease, _attempt, retries, max_retries in jobs
            ],
        )
        audit += audit_events(
            actor=actor,
            action=actions.WORKER_STATUS_CHANGED,
            target_type="worker",
            rows=[
                (pk, {"from": before, "to": after, "reason": f"job {workers[pk][2]} {reason}"})
                for pk, (before, after) in freed.items()
                if before != after
            ],
        )
        audit_write(audit)
        metrics.requeued_on_commit(len(jobs), retry_spent=False)

        transaction.on_commit(dispatch_pending, robust=True)
    result = {"jobs": len(jobs), "workers_freed": len(freed)}
    logger.info("dispatch-ack sweep: %(jobs)d job(s) requeued, %(workers_freed)d worker(s) freed", result)
    return result
