"""Every write to jobs: submission, dispatch, status reports, cancellation, and requeue after a lost attempt."""

import logging
import math

from django.conf import settings
from django.db import transaction
from django.db.models import Case, F, IntegerField, Value, When
from django.utils import timezone

from audit import actions
from audit.services import Actor, audit_record
from simpletuner_site import metrics
from simpletuner_site.errors import Conflict, InvalidInput, InvalidTransition, NotFound, StaleReport
from workers import events
from workers.models import Worker, WorkerStatus, WorkerType
from workers.services import worker_resting_status, worker_transition

from .models import (
    JOB_ACTIVE,
    JOB_RETRYABLE,
    JOB_TERMINAL,
    JOB_TRANSITIONS,
    REPORTED_STATUS,
    AttemptOutcome,
    Job,
    JobAttempt,
    JobStatus,
    JobTarget,
    job_fits_worker,
    new_lease_id,
)

logger = logging.getLogger(__name__)

SYSTEM = Actor.system("dispatcher")
LOG_TAIL_MAX_CHARS = 16_000
CANDIDATE_BATCH = 200

# Which worker types may run a job of each target. `auto` prefers remote workers (ordered first).
TARGET_WORKER_TYPES = {
    JobTarget.WORKER: (WorkerType.EPHEMERAL, WorkerType.PERSISTENT),
    JobTarget.LOCAL: (WorkerType.LOCAL,),
    JobTarget.AUTO: (WorkerType.EPHEMERAL, WorkerType.PERSISTENT, WorkerType.LOCAL),
}


def targets_for_worker_type(worker_type):
    """Return the job targets a worker of ``worker_type`` may run."""
    return [target for target, types in TARGET_WORKER_TYPES.items() if worker_type in types]


# --- the one writer of Job.status ---------------------------------------------------------------


def lock_job(job_id):
    """Return the job row locked for update, or None."""
    return Job.objects.select_for_update().filter(pk=job_id).first()


def job_transition(*, job, to, actor, reason="", **fields):
    """Move a locked ``job`` to ``to`` with ``fields``, audited; raise InvalidTransition if not allowed."""
    before = job.status
    if before not in JOB_TRANSITIONS[to]:
        raise InvalidTransition(f"job {job.pk} cannot go from {before} to {to}")
    updated = Job.objects.filter(pk=job.pk, status=before).update(status=to, **fields)
    if updated != 1:
        raise InvalidTransition(f"job {job.pk} changed status concurrently; from {before} to {to} refused")
    for name, value in fields.items():
        setattr(job, name, value)
    job.status = to
    details = {"from": before, "to": to, "reason": reason, "attempt": job.attempt_count}
    if job.worker_id:
        details["worker"] = job.worker_id
    audit_record(actor=actor, action=actions.JOB_STATUS_CHANGED, target_type="job", target_id=job.pk, details=details)
    return job


def job_is_live(job):
    return job.status in JOB_ACTIVE


def _finish_attempt(job, outcome, error=""):
    if job.lease_id:
        JobAttempt.objects.filter(lease_id=job.lease_id, outcome="").update(
            outcome=outcome, error=error[:4000], finished_at=timezone.now()
        )


# --- payloads sent to agents --------------------------------------------------------------------


def job_submit_payload(job):
    """Return the ``job_submit`` event data for the job's current attempt."""
    return {
        "job_id": job.pk,
        "config_name": job.config_name,
        "config": job.config,
        "dataloader": job.dataloader,
        "upload_endpoint": f"/api/workers/job/{job.pk}/status",
        "attempt": job.lease_id,
        "attempt_number": job.attempt_count,
    }


def job_resume_payload(job):
    """Return the ``resume_job`` object of a register response."""
    return {"job_id": job.pk, "status": job.status, "attempt": job.lease_id, "attempt_number": job.attempt_count}


def job_redeliver_on_commit(*, job_id, worker_id):
    """Re-send ``job_submit`` for a dispatch the worker has not acknowledged yet (same lease)."""
    job = Job.objects.filter(pk=job_id, worker_id=worker_id, status=JobStatus.DISPATCHED).first()
    if job is not None:
        events.publish_on_commit(worker_id, events.JOB_SUBMIT, **job_submit_payload(job))


# --- submission and cancellation ----------------------------------------------------------------


def required_gpus(*, gpu_count, config):
    """Return the GPUs a job needs: the request's ``gpu_count``, else the config's ``num_processes``, else 0."""
    if gpu_count is not None:
        return gpu_count
    for key in ("num_processes", "--num_processes"):
        value = (config or {}).get(key)
        if value not in (None, ""):
            try:
                number = int(value)
            except (TypeError, ValueError):
                raise InvalidInput(f"config {key} must be an integer, got {value!r}", code="invalid_config") from None
            if number < 0:
                raise InvalidInput(f"config {key} must be >= 0", code="invalid_config")
            return number
    return 0


def job_submit(
    *,
    config_name,
    actor,
    config=None,
    dataloader=None,
    target=JobTarget.WORKER,
    worker_labels=None,
    gpu_count=None,
    priority=0,
    max_retries=None,
    retry_on_failure=False,
    retry_of=None,
    dispatch=True,
):
    """Queue a job and (unless ``dispatch`` is false) try to dispatch it at once; return ``(job, dispatched)``."""
    config = config or {}
    with transaction.atomic():
        job = Job.objects.create(
            retry_of=retry_of,
            config_name=config_name,
            config=config,
            dataloader=dataloader,
            target=target,
            worker_labels=worker_labels or {},
            gpu_count=required_gpus(gpu_count=gpu_count, config=config),
            priority=priority,
            max_retries=settings.SIMPLETUNER["JOB_MAX_RETRIES"] if max_retries is None else max_retries,
            retry_on_failure=retry_on_failure,
            submitted_by_id=actor.user_id,
        )
        audit_record(
            actor=actor,
            action=actions.JOB_SUBMITTED,
            target_type="job",
            target_id=job.pk,
            details={
                "config_name": config_name,
                "target": target,
                "worker_labels": job.worker_labels,
                "gpu_count": job.gpu_count,
                "priority": priority,
                "max_retries": job.max_retries,
                **({"retry_of": retry_of.pk} if retry_of else {}),
            },
        )
    if not dispatch:
        return job, False
    worker = dispatch_for_job(job.pk)
    job.refresh_from_db()
    return job, worker is not None


def job_cancel(*, job_id, actor):
    """Cancel a job. A queued job stops at once; a dispatched or running one is told to stop on its worker.

    Raise NotFound, or Conflict if the job already finished.
    """
    with transaction.atomic():
        job = lock_job(job_id)
        if job is None:
            raise NotFound(f"job {job_id} does not exist")
        if job.status in JOB_TERMINAL:
            raise Conflict(f"job {job.pk} already {job.status}", code="job_finished")
        was = job.status
        audit_record(
            actor=actor,
            action=actions.JOB_CANCEL_REQUESTED,
            target_type="job",
            target_id=job.pk,
            details={"status": was, "worker": job.worker_id},
        )
        _finish_attempt(job, AttemptOutcome.CANCELLED, "cancelled by operator")
        job_transition(job=job, to=JobStatus.CANCELLED, actor=actor, reason="cancelled", finished_at=timezone.now())
        if was in JOB_ACTIVE and job.worker_id:
            # The worker stays busy with it until the agent reports the process has stopped.
            events.publish_on_commit(job.worker_id, events.JOB_CANCEL, job_id=job.pk, attempt=job.lease_id)
    return job


def job_retry(*, job_id, actor):
    """Submit a new job with the settings of failed or cancelled job ``job_id``; return ``(job, dispatched)``.

    The finished job stays as it was (its attempts and audit trail are history); the new one records
    which job it retries. Raise NotFound, or Conflict if the job is queued, running or completed, if its
    worker is still stopping it (a cancel not yet confirmed), or if an earlier retry of it is unfinished.
    """
    with transaction.atomic():
        original = lock_job(job_id)  # two retries of one job at once: the second sees the first's
        if original is None:
            raise NotFound(f"job {job_id} does not exist")
        if original.status not in JOB_RETRYABLE:
            raise Conflict(
                f"job {original.pk} is {original.status}; only failed or cancelled jobs can be retried",
                code="job_not_retryable",
            )
        stopping_on = Worker.objects.filter(current_job_id=original.pk).values_list("name", flat=True).first()
        if stopping_on is not None:
            raise Conflict(
                f"job {original.pk} is still stopping on worker {stopping_on}; retry it once it has stopped",
                code="job_still_stopping",
            )
        pending = original.retries.exclude(status__in=JOB_TERMINAL).values_list("pk", "status").first()
        if pending is not None:
            raise Conflict(
                f"job {original.pk} was already retried as {pending[0]}, which is {pending[1]}",
                code="job_already_retried",
            )
        job, _ = job_submit(
            config_name=original.config_name,
            config=original.config,
            dataloader=original.dataloader,
            target=original.target,
            worker_labels=original.worker_labels,
            gpu_count=original.gpu_count,
            priority=original.priority,
            max_retries=original.max_retries,
            retry_on_failure=original.retry_on_failure,
            retry_of=original,
            actor=actor,
            dispatch=False,
        )
        audit_record(
            actor=actor,
            action=actions.JOB_RETRIED,
            target_type="job",
            target_id=original.pk,
            details={"status": original.status, "new_job": job.pk},
        )
    worker = dispatch_for_job(job.pk)
    job.refresh_from_db()
    return job, worker is not None


# --- losing an attempt --------------------------------------------------------------------------


def job_release_from_worker(*, job, worker, actor, reason):
    """Take a locked ``job`` back from ``worker``, which no longer runs it (the caller updates the worker).

    Unacknowledged dispatch: back to the queue, no retry spent. Running: requeue while retries remain,
    else fail for good. A cancelled job only loses its worker.
    """
    if job.worker_id != worker.pk or job.status not in JOB_ACTIVE:
        return job
    if job.status == JobStatus.DISPATCHED:
        _finish_attempt(job, AttemptOutcome.UNACKNOWLEDGED, reason)
        return _requeue(job=job, actor=actor, reason=reason, spend_retry=False)
    _finish_attempt(job, AttemptOutcome.LOST, reason)
    return _requeue_or_fail(job=job, actor=actor, reason=reason)


def _requeue(*, job, actor, reason, spend_retry):
    fields = {"worker": None, "lease_id": None, "dispatched_at": None, "started_at": None}
    if spend_retry:
        fields["retry_count"] = job.retry_count + 1
    previous_worker = job.worker_id
    job_transition(job=job, to=JobStatus.QUEUED, actor=actor, reason=reason, last_error=reason[:4000], **fields)
    audit_record(
        actor=actor,
        action=actions.JOB_REQUEUED,
        target_type="job",
        target_id=job.pk,
        details={
            "reason": reason,
            "retry_spent": spend_retry,
            "retry_count": job.retry_count,
            "max_retries": job.max_retries,
            "previous_worker": previous_worker,
        },
    )
    metrics.requeued_on_commit(retry_spent=spend_retry)
    dispatch_on_commit(job_id=job.pk)
    return job


def _requeue_or_fail(*, job, actor, reason):
    if job.retry_count < job.max_retries:
        return _requeue(job=job, actor=actor, reason=reason, spend_retry=True)
    final = f"{reason}; retries exhausted ({job.retry_count} of {job.max_retries} used)"
    job_transition(
        job=job, to=JobStatus.FAILED, actor=actor, reason=final, last_error=final[:4000], finished_at=timezone.now()
    )
    metrics.retries_exhausted_on_commit()
    return job


# --- worker reports -----------------------------------------------------------------------------


def _normalise_progress(value):
    if value is None:
        return None
    if isinstance(value, bool):
        raise InvalidInput("progress must be a number or an object", code="invalid_progress")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise InvalidInput("progress must be a finite number >= 0", code="invalid_progress")
        return {"fraction": min(value if value <= 1 else value / 100.0, 1.0)}
    if isinstance(value, dict):
        return value
    raise InvalidInput("progress must be a number or an object", code="invalid_progress")


def _progress_fields(data):
    fields = {}
    progress = _normalise_progress(data.get("progress"))
    if progress is not None:
        fields["progress"] = progress
    log_tail = data.get("log_tail")
    if log_tail is not None:
        if isinstance(log_tail, list):
            log_tail = "\n".join(str(line) for line in log_tail)
        fields["log_tail"] = str(log_tail)[-LOG_TAIL_MAX_CHARS:]
    if data.get("exit_code") is not None:
        try:
            fields["exit_code"] = int(data["exit_code"])
        except (TypeError, ValueError):
            raise InvalidInput("exit_code must be an integer", code="invalid_exit_code") from None
    return fields


def job_record_progress(*, job_id, worker, data):
    """Store progress and log tail sent with a heartbeat for the worker's own live job."""
    fields = _progress_fields(data)
    if fields:
        Job.objects.filter(pk=job_id, worker_id=worker.pk, status__in=JOB_ACTIVE).update(**fields)


def _free_worker(*, worker, actor, reason):
    now = timezone.now()
    if worker.status == WorkerStatus.OFFLINE:
        Worker.objects.filter(pk=worker.pk).update(current_job=None, last_job_finished_at=now)
        return
    worker_transition(
        worker=worker,
        to=worker_resting_status(worker, busy=False),
        actor=actor,
        reason=reason,
        current_job=None,
        last_job_finished_at=now,
    )
    if worker.status == WorkerStatus.IDLE and worker.worker_type != WorkerType.EPHEMERAL:
        # An ephemeral agent leaves after its job; it gets another only by asking (GET /api/workers/queue).
        dispatch_on_commit(worker_id=worker.pk)


def job_reconcile_idle_agent(*, worker, actor):
    """Free a locked ``worker`` whose agent says it runs nothing while it holds a cancelled job."""
    job = lock_job(worker.current_job_id)
    if job is None or job.status == JobStatus.CANCELLED:
        _free_worker(worker=worker, actor=actor, reason="agent reports no job after cancel")


def job_report(*, worker_id, job_id, data, actor):
    """Apply a worker's status report for ``job_id``; return ``{"job_id", "status", "accepted"}``.

    Only the worker holding the job's current attempt may report (``attempt`` fences older ones).
    Raise NotFound, StaleReport (409) for a job or attempt it no longer owns, or InvalidTransition.
    """
    raw = data.get("status")
    if raw not in REPORTED_STATUS:
        raise InvalidInput(f"status must be one of {', '.join(REPORTED_STATUS)}", code="invalid_status")
    target = REPORTED_STATUS[raw]
    lease = data.get("attempt") or data.get("lease_id")
    error = str(data.get("error") or "")
    with transaction.atomic():
        # Worker before job, the order every worker-side service locks in (heartbeat, register,
        # disconnect); the other order deadlocks against a concurrent heartbeat of the same agent.
        worker = Worker.objects.select_for_update().get(pk=worker_id)
        job = lock_job(job_id)
        if job is None:
            raise NotFound(f"job {job_id} does not exist")
        refusal = None
        if job.worker_id != worker.pk:
            refusal = ("job_not_owned", f"job {job.pk} is not assigned to worker {worker.name}; stop it")
        elif lease and lease != job.lease_id:
            refusal = ("stale_attempt", f"attempt {lease} of job {job.pk} is no longer current; stop it")
        elif job.status == JobStatus.CANCELLED and target == JobStatus.RUNNING:
            refusal = ("job_cancelled", f"job {job.pk} was cancelled; stop it")
            events.publish_on_commit(worker.pk, events.JOB_CANCEL, job_id=job.pk, attempt=job.lease_id)
        if refusal:
            audit_record(
                actor=actor,
                action=actions.JOB_REPORT_REFUSED,
                target_type="job",
                target_id=job.pk,
                details={"reported": raw, "attempt": lease, "reason": refusal[0]},
                success=False,
            )
            # Keep the refusal's audit row: commit it, then raise outside the transaction.
        else:
            result = _apply_report(job=job, worker=worker, raw=raw, target=target, error=error, data=data, actor=actor)
    if refusal:
        raise StaleReport(refusal[1], code=refusal[0], extra={"abandon_job": job.pk})
    return result


def _apply_report(*, job, worker, raw, target, error, data, actor):
    fields = _progress_fields(data)
    owns_worker = worker.current_job_id == job.pk

    if job.status == JobStatus.CANCELLED:  # the agent confirms the process stopped
        if fields:
            Job.objects.filter(pk=job.pk).update(**fields)
        if owns_worker:
            _free_worker(worker=worker, actor=actor, reason=f"job {job.pk} stopped after cancel")
        return {"job_id": job.pk, "status": job.status, "accepted": True}

    if job.status in JOB_TERMINAL:
        if job.status == target:
            return {"job_id": job.pk, "status": job.status, "accepted": True}
        raise InvalidTransition(f"job {job.pk} already {job.status}; {raw} refused")

    now = timezone.now()
    if target == JobStatus.RUNNING:
        if job.status == JobStatus.DISPATCHED:
            job_transition(job=job, to=JobStatus.RUNNING, actor=actor, reason=raw, started_at=now, **fields)
            JobAttempt.objects.filter(lease_id=job.lease_id).update(started_at=now)
            metrics.acknowledged_on_commit(dispatched_at=job.dispatched_at, started_at=now)
        elif fields:
            Job.objects.filter(pk=job.pk).update(**fields)
        return {"job_id": job.pk, "status": job.status, "accepted": True}

    if target == JobStatus.COMPLETED:
        _finish_attempt(job, AttemptOutcome.COMPLETED)
        progress = fields.pop("progress", None) or dict(job.progress or {})
        progress["fraction"] = 1.0
        job_transition(
            job=job, to=JobStatus.COMPLETED, actor=actor, reason=raw, finished_at=now, progress=progress, **fields
        )
    elif target == JobStatus.FAILED:
        reason = error or "trainer failed"
        _finish_attempt(job, AttemptOutcome.FAILED, reason)
        if job.retry_on_failure:
            Job.objects.filter(pk=job.pk).update(**fields)
            _requeue_or_fail(job=job, actor=actor, reason=f"attempt {job.attempt_count} failed: {reason}")
        else:
            job_transition(
                job=job, to=JobStatus.FAILED, actor=actor, reason=reason, last_error=reason[:4000], finished_at=now, **fields
            )
    else:  # the agent stopped the job on its own (e.g. shutting down): the attempt is lost
        reason = error or "stopped by the worker"
        _finish_attempt(job, AttemptOutcome.CANCELLED, reason)
        Job.objects.filter(pk=job.pk).update(**fields)
        _requeue_or_fail(job=job, actor=actor, reason=f"attempt {job.attempt_count} stopped by worker: {reason}")

    if owns_worker:
        _free_worker(worker=worker, actor=actor, reason=f"job {job.pk} {raw}")
    return {"job_id": job.pk, "status": job.status, "accepted": True}


# --- dispatch -----------------------------------------------------------------------------------


def _assign(*, job, worker, actor):
    now = timezone.now()
    lease = new_lease_id()
    number = job.attempt_count + 1
    job_transition(
        job=job,
        to=JobStatus.DISPATCHED,
        actor=actor,
        reason=f"dispatched to {worker.name}",
        worker=worker,
        worker_name=worker.name,
        lease_id=lease,
        attempt_count=number,
        dispatched_at=now,
    )
    worker_transition(worker=worker, to=WorkerStatus.BUSY, actor=actor, reason=f"dispatched job {job.pk}", current_job=job)
    JobAttempt.objects.create(
        job=job, number=number, lease_id=lease, worker=worker, worker_name=worker.name, dispatched_at=now
    )
    audit_record(
        actor=actor,
        action=actions.JOB_DISPATCHED,
        target_type="job",
        target_id=job.pk,
        details={"worker": worker.pk, "worker_name": worker.name, "attempt": number, "lease": lease},
    )
    events.publish_on_commit(worker.pk, events.JOB_SUBMIT, **job_submit_payload(job))
    metrics.dispatched_on_commit(job=job, dispatched_at=now)


def _available_workers():
    return Worker.objects.filter(status=WorkerStatus.IDLE, current_job__isnull=True, stream_id__isnull=False)


def _lock_available_worker(worker_id):
    return _available_workers().select_for_update(skip_locked=True).filter(pk=worker_id).first()


def dispatch_for_job(job_id, *, actor=SYSTEM):
    """Dispatch queued job ``job_id`` to the best available worker; return the worker or None.

    Workers that fit are tried least-recently-used first (remote before local for ``auto``); a worker
    taken concurrently is skipped. Never dispatches a job twice nor gives a worker two jobs.
    """
    with transaction.atomic():
        job = Job.objects.select_for_update(skip_locked=True).filter(pk=job_id, status=JobStatus.QUEUED).first()
        if job is None:
            return None
        candidates = (
            _available_workers()
            .filter(worker_type__in=TARGET_WORKER_TYPES[job.target], gpu_count__gte=job.gpu_count)
            .annotate(
                local_last=Case(When(worker_type=WorkerType.LOCAL, then=Value(1)), default=Value(0), output_field=IntegerField())
            )
            .order_by("local_last", F("last_job_finished_at").asc(nulls_first=True), "pk")
            .only("pk", "labels", "gpu_count")
        )
        for candidate in candidates.iterator(chunk_size=CANDIDATE_BATCH):
            if not job_fits_worker(job, candidate):
                continue
            worker = _lock_available_worker(candidate.pk)
            if worker is None:
                continue
            _assign(job=job, worker=worker, actor=actor)
            return worker
    return None


def dispatch_for_worker(worker_id, *, actor=SYSTEM):
    """Give available worker ``worker_id`` the highest-priority, oldest queued job it fits; return it or None."""
    with transaction.atomic():
        worker = _lock_available_worker(worker_id)
        if worker is None or worker.drain_requested_at is not None:
            return None
        candidates = (
            Job.objects.filter(
                status=JobStatus.QUEUED,
                target__in=targets_for_worker_type(worker.worker_type),
                gpu_count__lte=worker.gpu_count,
            )
            .order_by("-priority", "submitted_at", "pk")
            .only("pk", "worker_labels", "gpu_count")
        )
        for candidate in candidates.iterator(chunk_size=CANDIDATE_BATCH):
            if not job_fits_worker(candidate, worker):
                continue
            job = Job.objects.select_for_update(skip_locked=True).filter(pk=candidate.pk, status=JobStatus.QUEUED).first()
            if job is None:
                continue
            _assign(job=job, worker=worker, actor=actor)
            return job
    return None


def dispatch_pending(*, limit=1000, actor=SYSTEM):
    """Dispatch queued jobs in priority order while workers are available; return how many went out."""
    dispatched = 0
    if not _available_workers().exists():
        return 0
    queued = (
        Job.objects.filter(status=JobStatus.QUEUED)
        .order_by("-priority", "submitted_at", "pk")
        .values_list("pk", flat=True)[:limit]
    )
    for job_id in list(queued):
        if dispatch_for_job(job_id, actor=actor) is not None:
            dispatched += 1
            if not _available_workers().exists():
                break
    return dispatched


def dispatch_on_commit(*, worker_id=None, job_id=None):
    """After the current transaction commits, try to dispatch for ``worker_id`` or ``job_id``."""

    def _run():
        if worker_id is not None:
            dispatch_for_worker(worker_id)
        if job_id is not None:
            dispatch_for_job(job_id)

    transaction.on_commit(_run, robust=True)


def worker_has_jobs(*, worker_id):
    """Return whether a queued job fits the worker (what an ephemeral agent asks after its job).

    If one does and the worker is available, dispatch it now.
    """
    worker = Worker.objects.filter(pk=worker_id).first()
    if worker is None or worker.drain_requested_at is not None:
        return False
    candidates = Job.objects.filter(
        status=JobStatus.QUEUED, target__in=targets_for_worker_type(worker.worker_type), gpu_count__lte=worker.gpu_count
    ).only("pk", "worker_labels", "gpu_count")
    has_jobs = any(job_fits_worker(job, worker) for job in candidates.iterator(chunk_size=CANDIDATE_BATCH))
    if has_jobs and worker.status == WorkerStatus.IDLE:
        dispatch_for_worker(worker.pk)
    return has_jobs
