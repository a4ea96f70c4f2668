"""A worker's reports on its job: status reports (fenced by attempt) and the progress its heartbeats carry."""

import math

from django.utils import timezone

from artifacts import services as artifact_services
from audit import actions
from audit.events import announce_changes_on_commit
from audit.services import audit_record, audited_atomic
from common.errors import InvalidInput, InvalidTransition, NotFound, StaleReport
from worker_agent import protocol
from workers import events as worker_events
from workers.models import Worker
from workers.services import lock_workers
from workers.throttling import worker_refused

from . import gangs
from .dispatch import redispatch_on_commit, worker_holds, worker_jobs_over
from .models import JOB_ACTIVE, JOB_TERMINAL, REPORTED_STATUS, AttemptOutcome, Job, JobStatus
from .services import lock_job
from .logs import attempt_append_log
from .progress_history import attempt_record_progress
from .transitions import (
    ERROR_MAX_CHARS,
    attempts_finish,
    jobs_acknowledge,
    jobs_recover_completion,
    jobs_release,
    jobs_transition,
    operator_interruption,
    recoverable_attempt,
)

def _normalise_progress(value):
    """Return a report's progress as an object, or None: a bare number is a fraction (or a percentage);
    anything else that is not an object is ignored, never refused (trainer output)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            return None
        return {"fraction": min(value if value <= 1 else value / 100.0, 1.0)}
    return value if isinstance(value, dict) else None


def _progress_fields(data):
    """Return the Job fields a report or heartbeat carries: progress, log tail, exit code (validated and
    cleaned by the serializers: ``common.fields.TrainerJSON``, ``TrainerLog``, ``BoundedInt``)."""
    fields = {}
    progress = _normalise_progress(data.get("progress"))
    if progress is not None:
        fields["progress"] = progress
    if data.get("log_tail") is not None:
        fields["log_tail"] = data["log_tail"]
    if data.get("exit_code") is not None:
        fields["exit_code"] = data["exit_code"]
    return fields


def attempt_spoke(*, job, data, actor, now=None):
    """The job's current attempt reported or heartbeat: the checkpoints it uploaded before are complete,
    and the step its progress names is the furthest it reached. Call in the report's transaction."""
    now = now or timezone.now()
    artifact_services.checkpoints_complete(lease_id=job.lease_id, actor=actor, now=now)
    progress = data.get("progress")
    step = progress.get("step") if isinstance(progress, dict) else None
    if isinstance(step, int) and not isinstance(step, bool) and 0 <= step < 2**62:
        artifact_services.attempt_steps_record(lease_id=job.lease_id, job_id=job.pk, reached_step=step)


def job_record_progress(*, job_id, worker, data):
    """Store progress and log tail sent with a heartbeat for the worker's own live job."""
    fields = _progress_fields(data)
    if fields:
        updated = Job.objects.filter(pk=job_id, worker_id=worker.pk, status__in=JOB_ACTIVE).update(**fields)
        lease = Job.objects.filter(pk=job_id).values_list("lease_id", flat=True).first() if updated else None
        attempt_record_progress(lease_id=lease, progress=fields.get("progress"))
        if updated:
            announce_progress(job_id)


def announce_progress(job_id):
    """Name ``job_id`` on the operators' change feed once the transaction commits: its progress or log moved.

    No audit row records progress, so this is the feed's only word of it (`simpletuner jobs watch` and the job's
    admin page re-read the job on it)."""
    announce_changes_on_commit([("job", job_id)])


class _HolderNotLocked(Exception):
    """The late completion supersedes an attempt whose worker is not locked yet: lock it first and retry."""

    def __init__(self, holder_id):
        super().__init__(holder_id)
        self.holder_id = holder_id


def job_report(*, worker_id, job_id, data, actor):
    """Apply a worker's status report for ``job_id``; return ``{"job_id", "status", "accepted"}``.

    Only the worker holding the job's current attempt may report (``attempt`` fences older ones),
    with one exception: the completion of a lost attempt is accepted while the job has not finished,
    superseding the attempt that runs it meanwhile, if any (``jobs_recover_completion``). Raise
    NotFound, StaleReport (409) for a job or attempt it no longer owns (its audit row bounded per worker
    and window: ``workers.throttling.worker_refused``), or InvalidTransition.
    """
    raw = data.get("status")
    if raw not in REPORTED_STATUS:
        raise InvalidInput(f"status must be one of {', '.join(protocol.REPORTED_STATUSES)}", code="invalid_status")
    holder_id = None
    for _ in range(3):  # the job's holder changes between tries only under a concurrent dispatch
        try:
            return _job_report(worker_id=worker_id, job_id=job_id, data=data, actor=actor, holder_id=holder_id)
        except _HolderNotLocked as retry:
            holder_id = retry.holder_id
    raise StaleReport(f"job {job_id} is changing hands; report again", code=protocol.STALE_ATTEMPT)


def _job_report(*, worker_id, job_id, data, actor, holder_id):
    raw = data.get("status")
    target = REPORTED_STATUS[raw]
    lease = data.get("attempt") or data.get("lease_id")
    error = str(data.get("error") or "")
    with audited_atomic():
        # Workers before the job, in id order: the order every worker-side service locks in (heartbeat,
        # register, disconnect); the other order deadlocks against a concurrent heartbeat of the same agent.
        workers = lock_workers({worker_id, holder_id} - {None})
        worker = workers.get(worker_id) or Worker.objects.get(pk=worker_id)  # DoesNotExist: the caller's 404
        job = lock_job(job_id)
        if job is None:
            raise NotFound(f"job {job_id} does not exist")
        # (A multi-node job's attempt is its gang's: one member's late word completes nothing.)
        late = target == JobStatus.COMPLETED and job.num_nodes <= 1 and recoverable_attempt(job=job, worker=worker, lease_id=lease)
        if late:
            # The attempt was taken back (its worker went silent, or never acknowledged) but did finish:
            # keep the result rather than run the job again, and stop whatever runs it meanwhile.
            holder = workers.get(job.worker_id) if job.worker_id else None
            if job.status in JOB_ACTIVE and job.worker_id and holder is None:
                raise _HolderNotLocked(job.worker_id)  # rolls back; locked in order on the next try
            held = holder is not None and worker_holds(holder, job)
            superseded = jobs_recover_completion(
                job=job, attempt=late, actor=actor, journal=bool(data.get("journal")), **_progress_fields(data)
            )
            if superseded and holder is not None:
                worker_events.publish_on_commit(holder.pk, protocol.JOB_CANCEL, job_id=job.pk, attempt=superseded)
                if held:
                    reason = f"job {job.pk} completed by an earlier attempt"
                    worker_jobs_over(worker=holder, job_ids=[job.pk], actor=actor, reason=reason)
            return {"job_id": job.pk, "status": job.status, "accepted": True}
        refusal = None
        if gangs.is_gang(job) and gangs.member_of(job, worker) is None:  # fenced per member of the current attempt
            refusal = (protocol.JOB_NOT_OWNED, f"worker {worker.name} is no member of job {job.pk}'s current attempt; stop it")
            if target != JobStatus.RUNNING and worker.packs and worker_holds(worker, job):
                # A member of an attempt that ended, on a packing worker: its agent says it runs the job no more.
                worker_jobs_over(worker=worker, job_ids=[job.pk], actor=actor, reason=f"job {job.pk} {raw} (attempt over)")
        elif not gangs.is_gang(job) and job.worker_id != worker.pk:
            refusal = (protocol.JOB_NOT_OWNED, f"job {job.pk} is not assigned to worker {worker.name}; stop it")
        elif lease and lease != job.lease_id:
            refusal = (protocol.STALE_ATTEMPT, f"attempt {lease} of job {job.pk} is no longer current; stop it")
        elif job.status == JobStatus.CANCELLED and target == JobStatus.RUNNING:
            refusal = (protocol.JOB_CANCELLED, f"job {job.pk} was cancelled; stop it")
            worker_events.publish_on_commit(worker.pk, protocol.JOB_CANCEL, job_id=job.pk, attempt=job.lease_id)
        if not refusal:
            attempt_append_log(lease_id=job.lease_id, chunk=data.get("log_lines"))
            attempt_record_progress(lease_id=job.lease_id, progress=_normalise_progress(data.get("progress")))
            result = _apply_report(job=job, worker=worker, raw=raw, target=target, error=error, data=data, actor=actor)
            if data.get("log_lines") or data.get("progress") is not None or job.status == JobStatus.CANCELLED:
                announce_progress(job.pk)  # (a cancelled job's report: its worker has stopped it)
    if refusal:
        # Always the 409 (with a cancel, the job_cancel committed above); its audit row is bounded per worker.
        worker_refused(
            worker_id=worker.pk,
            address=actor.ip,
            record=lambda previous: job_report_refused_audit(
                actor=actor, job_id=job.pk, details={"reported": raw, "attempt": lease, "reason": refusal[0]}, previous=previous
            ),
        )
        raise StaleReport(refusal[1], code=refusal[0], extra={"abandon_job": job.pk})
    return result


def job_report_refused_audit(*, actor, job_id, details, previous):
    """Audit a worker's refused report or heartbeat on ``job_id`` (``job.report_refused``, with ``details`` and the
    worker's refusals in the window before, ``previous``): the first refusal of its window, as
    ``workers.throttling.worker_refused`` decides."""
    with audited_atomic():
        audit_record(
            actor=actor,
            action=actions.JOB_REPORT_REFUSED,
            target_type="job",
            target_id=job_id,
            details={**details, "refusals_in_previous_window": previous},
            success=False,
        )


def _apply_report(*, job, worker, raw, target, error, data, actor):
    if job.lease_id:
        attempt_spoke(job=job, data=data, actor=actor)
    fields = _progress_fields(data)
    said = f"{raw} ({protocol.FROM_JOURNAL})" if data.get("journal") else raw
    owns_worker = worker_holds(worker, job)

    if job.status == JobStatus.CANCELLED:  # the agent confirms the process stopped
        if fields:
            Job.objects.filter(pk=job.pk).update(**fields)
        if owns_worker:
            worker_jobs_over(worker=worker, job_ids=[job.pk], actor=actor, reason=f"job {job.pk} stopped after cancel")
        return {"job_id": job.pk, "status": job.status, "accepted": True}

    if job.status in JOB_TERMINAL:
        if gangs.is_gang(job) and target != JobStatus.RUNNING and owns_worker:
            # A member told to stop when its attempt ended the job (retries used up): its agent runs it no more.
            worker_jobs_over(worker=worker, job_ids=[job.pk], actor=actor, reason=f"job {job.pk} {said} (attempt over)")
            return {"job_id": job.pk, "status": job.status, "accepted": True}
        if job.status == target:
            return {"job_id": job.pk, "status": job.status, "accepted": True}
        raise InvalidTransition(f"job {job.pk} already {job.status}; {raw} refused")

    if gangs.is_gang(job):
        return _apply_member_report(job=job, worker=worker, raw=raw, target=target, error=error, fields=fields, actor=actor)

    now = timezone.now()
    if target == JobStatus.RUNNING:
        if job.status == JobStatus.DISPATCHED:
            jobs_acknowledge(jobs=[job], actor=actor, reason=raw, now=now, **fields)
        elif fields:
            Job.objects.filter(pk=job.pk).update(**fields)
        return {"job_id": job.pk, "status": job.status, "accepted": True}

    requeued = False
    if target == JobStatus.COMPLETED:
        attempts_finish(lease_ids=[job.lease_id], outcome=AttemptOutcome.COMPLETED, now=now)
        progress = fields.pop("progress", None) or dict(job.progress or {})
        progress["fraction"] = 1.0
        jobs_transition(
            jobs=[job], to=JobStatus.COMPLETED, actor=actor, reason=said, finished_at=now, progress=progress, **fields
        )
    elif target == JobStatus.FAILED and not job.retry_on_failure:
        reason = error or "trainer failed"
        attempts_finish(lease_ids=[job.lease_id], outcome=AttemptOutcome.FAILED, error=reason, now=now)
        jobs_transition(
            jobs=[job], to=JobStatus.FAILED, actor=actor, reason=reason, last_error=reason[:ERROR_MAX_CHARS], finished_at=now, **fields
        )
    else:  # the attempt is over but the job may run again: it failed (retry_on_failure), or the agent stopped it
        if fields:
            Job.objects.filter(pk=job.pk).update(**fields)
        if target == JobStatus.FAILED:
            outcome, why = AttemptOutcome.FAILED, f"attempt {job.attempt_count} failed: {error or 'trainer failed'}"
        else:
            outcome, why = AttemptOutcome.CANCELLED, f"attempt {job.attempt_count} stopped by worker: {error or 'stopped by the worker'}"
        # The report itself acknowledges the attempt, even one that never said `starting`.
        released = jobs_release(
            jobs=[job],
            actor=actor,
            reason=why,
            outcome=outcome,
            acknowledged=True,
            interrupted_by=operator_interruption(worker) if owns_worker and outcome == AttemptOutcome.CANCELLED else None,
            now=now,
        )
        redispatch_on_commit(released)
        requeued = bool(released.requeued)

    if owns_worker:
        # A job put back on the queue goes to the best worker after the commit (least recently used first,
        # so rarely the one it just left); the worker is offered work then too, after that job is placed.
        worker_jobs_over(worker=worker, job_ids=[job.pk], actor=actor, reason=f"job {job.pk} {raw}", at_once=not requeued)
    return {"job_id": job.pk, "status": job.status, "accepted": True}


def _apply_member_report(*, job, worker, raw, target, error, fields, actor):
    """Apply the report of ``worker``, a member of active multi-node ``job``'s current attempt (job_queue.gangs).

    Running: its acknowledgement (the job runs once every member's is in). Completed: its part is done and its worker
    free; the job completes with the last member. Failed, or stopped by its worker: the attempt is over for every
    member (the others are told to stop) and the job is requeued as a whole, spending one retry (none when an
    operator's drain stopped it), or fails once none is left. Rank 0's progress, log tail and exit code are the job's."""
    accepted = {"job_id": job.pk, "status": job.status, "accepted": True}
    member = gangs.live_member(job, worker)
    if member is None:  # its part ended already (it says so again)
        return accepted
    now = timezone.now()
    own = fields if member.rank == 0 else {}
    if target == JobStatus.RUNNING:
        if not gangs.acknowledge_by(worker=worker, jobs=[job], actor=actor, reason=f"{raw} (every member)", now=now, **own) and own:
            Job.objects.filter(pk=job.pk).update(**own)
        return {**accepted, "status": job.status}
    reason = f"job {job.pk} {raw} (rank {member.rank})"
    if target == JobStatus.COMPLETED:
        if gangs.member_completed(job=job, worker=worker, now=now):
            attempts_finish(lease_ids=[job.lease_id], outcome=AttemptOutcome.COMPLETED, now=now)
            progress = own.pop("progress", None) or dict(job.progress or {})
            progress["fraction"] = 1.0
            jobs_transition(
                jobs=[job], to=JobStatus.COMPLETED, actor=actor, reason=f"{raw}: every member", finished_at=now,
                started_at=job.started_at or now, progress=progress, **own,
            )
        elif own:
            Job.objects.filter(pk=job.pk).update(**own)
        worker_jobs_over(worker=worker, job_ids=[job.pk], actor=actor, reason=reason)
        return {**accepted, "status": job.status}
    if own:
        Job.objects.filter(pk=job.pk).update(**own)
    if target == JobStatus.FAILED:
        outcome, lost = AttemptOutcome.FAILED, gangs.MEMBER_FAILED
        why = f"attempt {job.attempt_count} failed on {worker.name} (rank {member.rank}): {error or 'trainer failed'}"
    else:
        outcome, lost = AttemptOutcome.CANCELLED, gangs.MEMBER_CANCELLED
        why = f"attempt {job.attempt_count} stopped by {worker.name} (rank {member.rank}): {error or 'stopped by the worker'}"
    gangs.attempt_lost(jobs=[job], outcome=lost, lost_workers=[worker.pk], now=now)
    released = jobs_release(
        jobs=[job], actor=actor, reason=why, outcome=outcome, acknowledged=True, now=now,
        interrupted_by=operator_interruption(worker) if outcome == AttemptOutcome.CANCELLED else None,
    )
    redispatch_on_commit(released)
    worker_jobs_over(worker=worker, job_ids=[job.pk], actor=actor, reason=reason, at_once=not released.requeued)
    return {**accepted, "status": job.status}
