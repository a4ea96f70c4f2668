"""Set-based sweeps that recover jobs: stale workers and unacknowledged dispatches.

A sweep selects what is stale (locking with ``skip_locked``, so two sweeps or a sweep and a request
never wait on each other) and hands the rows to the transitions; it writes nothing itself. The audit
rows of all its transitions are chained and saved in one batch (``audited_atomic``) before its transaction commits.
Each runs a fixed number of queries whatever the fleet size. The same functions run under Celery beat
and the embedded scheduler.
"""

import logging
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from audit.services import Actor, audited_atomic
from workers.models import WORKER_TRANSITIONS, Worker, WorkerStatus
from workers.selectors import servers_heard_silence, servers_silent_reason
from workers.transitions import workers_free, workers_transition

from . import fairshare, gangs, packing
from .dispatch import dispatch_pending, packing_workers_recount
from .models import JOB_ACTIVE, GangMember, Job, JobStatus
from .transitions import jobs_give_back_gpus, jobs_release, operator_interruption

logger = logging.getLogger(__name__)

HEALTH = Actor.system("health-sweep")
ACK_SWEEP = Actor.system("dispatch-ack-sweep")
# What the transitions read of a job and a worker: the sweeps load no more.
JOB_FIELDS = ("pk", "status", "worker_id", "lease_id", "attempt_count", "retry_count", "max_retries", "num_nodes")
WORKER_FIELDS = (
    "pk", "name", "status", "drain_requested_at", "current_job_id", "worker_type", "max_jobs", "gpu_slots", "gpus_free",
    "gang_rank",
)


def sweep_stale_workers(*, now=None, actor=HEALTH):
    """Take workers silent for longer than the heartbeat timeout offline and recover their jobs.

    Their jobs go through ``jobs_release``: one never acknowledged goes back to the queue without
    spending a retry; a running one is requeued while retries remain, else failed; one whose worker
    was draining (an operator's doing) is requeued without spending a retry. Nothing is taken
    offline while no server has been up long enough to hear the heartbeats (``servers_heard_silence``).
    Rows locked by a concurrent request or sweep are skipped and picked up by the next run. Return
    ``{"workers": n, "requeued": n, "failed": n}``.
    """
    now = now or timezone.now()
    timeout = settings.SIMPLETUNER["HEARTBEAT_TIMEOUT"]
    cutoff = now - timedelta(seconds=timeout)
    reason = f"no heartbeat for {timeout:g} s"
    nothing = {"workers": 0, "requeued": 0, "failed": 0}
    with audited_atomic():
        stale = list(
            Worker.objects.select_for_update(skip_locked=True)
            .filter(status__in=WORKER_TRANSITIONS[WorkerStatus.OFFLINE], last_heartbeat__lt=cutoff)
            .annotate(heard=servers_heard_silence(now=now, timeout=timeout))
            .order_by()  # the model's ordering (name) would make SQLite walk the name index, not worker_status_hb
            .only(*WORKER_FIELDS)
        )
        if not stale:
            return nothing
        if not stale[0].heard:
            _hold_back("health sweep: no worker taken offline: %s (their heartbeats had nowhere to go)", now, timeout)
            return nothing
        worker_ids = [w.pk for w in stale]
        # Their jobs: each one they hold (a multi-node job's members hold it too, whatever their rank).
        members = [w.current_job_id for w in stale if w.current_job_id and w.gang_rank]  # ranks 1 and up
        packers = [w.pk for w in stale if w.packs]
        if packers:  # and the gang members on packing workers' GPUs, rank 0 too (job_queue.packing)
            members += list(packing.holding_members(packers).values_list("job_id", flat=True))
        held = Q(worker_id__in=worker_ids) | Q(pk__in=members) if members else Q(worker_id__in=worker_ids)
        jobs = list(
            Job.objects.select_for_update(skip_locked=True)
            .filter(held, status__in=JOB_ACTIVE)
            .order_by()
            .only(*JOB_FIELDS)
        )
        # A multi-node job is lost only with a live member of its current attempt (its rank 0 may have completed its
        # part and left its worker meanwhile): one read of those members.
        live = gangs.live_leases(jobs, worker_ids)
        locked = [j.pk for j in jobs]
        jobs = [j for j in jobs if not gangs.is_gang(j) or j.lease_id in live]
        # A worker whose job another transaction holds right now (a cancel, the ack sweep) waits for the
        # next run: taking it offline now would clear its current job and leave that job orphaned.
        held_elsewhere = set(
            Job.objects.filter(worker_id__in=worker_ids, status__in=JOB_ACTIVE)
            .exclude(pk__in=locked)
            .order_by()
            .values_list("worker_id", flat=True)
        )
        if members:  # so does a live member of a multi-node job held elsewhere, whatever its rank (Job.worker is rank 0's)
            held_elsewhere.update(
                GangMember.objects.filter(worker_id__in=worker_ids, job_id__in=members, outcome="", job__status__in=JOB_ACTIVE)
                .exclude(job_id__in=locked)
                .values_list("worker_id", flat=True)
            )
        stale = [w for w in stale if w.pk not in held_elsewhere]
        if not stale:
            return nothing
        drained = {w.pk: operator_interruption(w) for w in stale}
        gang_drained = {j.pk: next((drained[w] for w in live.get(j.lease_id, ()) if drained.get(w)), None) for j in jobs}
        workers_transition(
            workers=stale, to=WorkerStatus.OFFLINE, actor=actor, reason=reason, current_job=None, gpus_free=0, now=now
        )
        packers = [w.pk for w in stale if w.packs]  # (those left)
        if packers:  # a cancelled job or a stopped gang member they held (not released below) gives its GPUs back
            jobs_give_back_gpus(worker_ids=packers)
        gangs.attempt_lost(jobs=jobs, outcome=gangs.MEMBER_LOST, lost_workers=worker_ids, now=now)
        released = jobs_release(
            interrupted_by=lambda j: gang_drained[j.pk] if gangs.is_gang(j) else drained.get(j.worker_id),
            jobs=jobs,
            actor=actor,
            reason=lambda j: (
                f"worker lost before acknowledging: {reason}" if j.status == JobStatus.DISPATCHED else f"worker lost: {reason}"
            ),
            now=now,
        )
        if released.requeued:
            transaction.on_commit(dispatch_pending, robust=True)
    result = {"workers": len(stale), "requeued": len(released.requeued), "failed": len(released.failed)}
    logger.info("health sweep: %(workers)d worker(s) offline, %(requeued)d job(s) requeued, %(failed)d failed", result)
    return result


def sweep_unacknowledged_dispatches(*, now=None, actor=ACK_SWEEP):
    """Put back on the queue every job dispatched longer than the acknowledgement timeout ago and never acknowledged.

    An agent acknowledges a ``job_submit`` (``starting``, or a heartbeat, re-registration or report
    naming the job) within milliseconds and a reconnecting stream redelivers it, so such a dispatch
    was lost in transit: ``jobs_release`` puts the job back
    without spending a retry and ends its attempt ``unacknowledged``, and the worker that held it is
    freed (busy -> idle, draining stays draining; an offline worker only loses its job). A late
    ``starting`` for the old attempt is then refused (409). A job or worker row locked by a concurrent
    request or sweep is skipped and picked up by the next run. Queued jobs are dispatched once the
    transaction commits. Nothing is requeued while no server has been up for a whole acknowledgement
    timeout (``servers_heard_silence``): after a restart the agents get that long to reconnect and
    acknowledge. Return ``{"jobs": n, "workers_freed": n}``.
    """
    now = now or timezone.now()
    timeout = settings.SIMPLETUNER["DISPATCH_ACK_TIMEOUT"]
    cutoff = now - timedelta(seconds=timeout)
    reason = f"dispatch not acknowledged within {timeout:g} s"
    nothing = {"jobs": 0, "workers_freed": 0}
    with audited_atomic():
        jobs = list(
            Job.objects.select_for_update(skip_locked=True)
            .filter(status=JobStatus.DISPATCHED, dispatched_at__lt=cutoff)
            .annotate(heard=servers_heard_silence(now=now, timeout=timeout))
            .order_by()  # the model's ordering (-submitted_at) would make SQLite walk that index instead
            .only(*JOB_FIELDS)
        )
        if not jobs:
            return nothing
        if not jobs[0].heard:
            _hold_back("dispatch-ack sweep: no dispatch requeued: %s (acknowledgements had nowhere to go)", now, timeout)
            return nothing
        workers = {
            w.pk: w
            for w in Worker.objects.select_for_update(skip_locked=True)
            .filter(pk__in={j.worker_id for j in jobs if j.worker_id is not None})
            .order_by()
            .only(*WORKER_FIELDS)
        }
        # A worker row locked elsewhere may be its agent acknowledging right now: leave its job to the next run.
        jobs = [j for j in jobs if j.worker_id is None or j.worker_id in workers]
        if not jobs:
            return nothing
        # A multi-node job's members stay busy until each agent says it runs the job no more (job_queue.gangs).
        holders = [
            workers[j.worker_id] for j in jobs
            if j.worker_id and workers[j.worker_id].current_job_id == j.pk and not gangs.is_gang(j)
        ]
        packed = {}  # packing worker -> its jobs requeued here (they hold no current_job)
        for job in jobs:
            if job.worker_id and workers[job.worker_id].packs:
                packed.setdefault(workers[job.worker_id], []).append(job.pk)
        why = {w.pk: f"job {w.current_job_id} {reason}" for w in holders}
        gangs.attempt_lost(jobs=jobs, outcome=gangs.MEMBER_LOST, now=now)
        jobs_release(jobs=jobs, actor=actor, reason=reason, now=now)
        workers_free(workers=holders, actor=actor, reason=lambda w: why[w.pk], now=now)
        if packed:  # they recount their free GPUs from the jobs they still hold; dispatch_pending offers them work
            why_packed = {w.pk: f"{len(ids)} job(s) {reason}" for w, ids in packed.items()}
            packing_workers_recount(workers=list(packed), job_ids=(), actor=actor, reason=lambda w: why_packed[w.pk], now=now)
        transaction.on_commit(dispatch_pending, robust=True)
    result = {"jobs": len(jobs), "workers_freed": len(holders) + len(packed)}
    logger.info("dispatch-ack sweep: %(jobs)d job(s) requeued, %(workers_freed)d worker(s) freed", result)
    return result


def _hold_back(message, now, timeout):
    """Log ``message`` with the reason why the workers' silence proves nothing yet (the sweep leaves its rows)."""
    logger.warning(message, servers_silent_reason(now=now, timeout=timeout) or "no server was up long enough")


def sweep_fairshare_charge():
    """Charge each share the GPU time its attempts held since the last charge (``job_queue.fairshare``); return how
    many attempts were charged."""
    return fairshare.fairshare_charge()
