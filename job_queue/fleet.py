"""Operators' actions on a worker that reach its job or the queue: rotating a busy worker's token, putting
a drained worker back in service, editing its labels (both offer it queued jobs again).

They live above both apps, like ``job_queue.agents``: each locks the worker, then its job, and changes
them only through ``workers.transitions`` and ``job_queue.transitions``.
"""

from audit import actions
from audit.services import audit_record, audited_atomic
from common.errors import Conflict
from workers import services as worker_services
from workers.models import WORKER_TRANSITIONS, Worker, WorkerStatus
from workers.services import clean_worker_labels, lock_worker
from workers.transitions import workers_transition

from .dispatch import dispatch_on_commit, redispatch_on_commit, worker_rest_and_offer
from . import gangs, packing
from .models import JOB_ACTIVE
from .services import lock_job
from .transitions import jobs_give_back_gpus, jobs_release

ROTATION = "token rotation"


def running_job(worker):
    """Return the active job the locked ``worker`` holds (locked), or None: on a packing worker, the first of them."""
    jobs = running_jobs(worker)
    return jobs[0] if jobs else None


def running_jobs(worker):
    """Return the active jobs the locked ``worker`` holds (locked): its current job, or a packing worker's jobs."""
    if worker.packs:
        return [job for job in packing.held_jobs(worker.pk, lock=True) if job.status in JOB_ACTIVE and not gangs.part_over(job)]
    job = lock_job(worker.current_job_id) if worker.current_job_id else None
    if job is not None and gangs.is_gang(job):  # a member of a multi-node job's current attempt holds it too
        return [job] if gangs.live_member(job, worker) is not None else []
    return [job] if job is not None and job.status in JOB_ACTIVE and job.worker_id == worker.pk else []


def rotation_warning(worker, job):
    """Return what rotating ``worker``'s token does to ``job``, which it runs (for a confirmation or a refusal)."""
    return (
        f"worker {worker.name} is running job {job.pk} ({job.config_name}, {job.status}): rotating its token "
        "closes its stream and its agent stops that job; the job goes back to the queue without spending a retry"
    )


def worker_rotate_token(*, worker_id, actor, force=False, confirmed_job=None):
    """Rotate the worker's token (``workers.services.worker_rotate_token``); return ``(plaintext, job id or None)``.

    A worker running a job is refused (Conflict ``worker_busy``, naming the job) unless ``force``: then
    the job is taken back at once and requeued without spending a retry (the operator ended it, not the
    job), and the worker goes offline until its agent is restarted with the new token. With
    ``confirmed_job`` (the job an operator was shown and confirmed), ``force`` stops only that job.
    """
    with audited_atomic():
        worker = lock_worker(worker_id)
        jobs = running_jobs(worker)
        job = jobs[0] if jobs else None
        if job is not None and (not force or confirmed_job not in (None, job.pk)):
            raise Conflict(
                rotation_warning(worker, job) + "; send force=true to rotate anyway",
                code="worker_busy",
                extra={"job_id": job.pk},
            )
        if job is not None:
            reason = f"the token of {worker.name} was rotated"
            gangs.attempt_lost(jobs=jobs, outcome=gangs.MEMBER_LOST, lost_workers=[worker.pk])  # the others stop
            released = jobs_release(jobs=jobs, actor=actor, reason=reason, interrupted_by=ROTATION)
            if worker.packs:  # every job and gang member it held gives its GPUs back (a cancelled one too)
                jobs_give_back_gpus(worker_ids=[worker.pk])
            if worker.status in WORKER_TRANSITIONS[WorkerStatus.OFFLINE]:
                workers_transition(
                    workers=[worker], to=WorkerStatus.OFFLINE, actor=actor, reason=f"{reason} while it ran job {job.pk}",
                    current_job=None, gpus_free=0,
                )
            else:
                Worker.objects.filter(pk=worker.pk).update(current_job=None, gpus_free=0)
            redispatch_on_commit(released)
        plaintext = worker_services.worker_rotate_token(worker_id=worker.pk, actor=actor)
    return plaintext, job.pk if job is not None else None


def _worker_write(worker, *, action, details, actor, **fields):
    """Write ``fields`` to the locked ``worker`` (row and object) with its audit row ``action``, ``details``."""
    Worker.objects.filter(pk=worker.pk).update(**fields)
    for name, value in fields.items():
        setattr(worker, name, value)
    audit_record(actor=actor, action=action, target_type="worker", target_id=worker.pk, details=details)


def worker_undrain(*, worker_id, actor):
    """Put a drained worker back in service: it takes jobs again (queued ones are offered to it at once).

    Idempotent: a worker not draining is returned unchanged, with no audit row. An offline worker comes
    back in service when its agent returns. Return the worker.
    """
    with audited_atomic():
        worker = lock_worker(worker_id)
        if worker.drain_requested_at is None:
            return worker
        details = {"status": worker.status, "current_job": worker.current_job_id}
        _worker_write(worker, action=actions.WORKER_UNDRAINED, details=details, actor=actor, drain_requested_at=None)
        if worker.status == WorkerStatus.DRAINING:
            worker_rest_and_offer(worker=worker, actor=actor, reason="put back in service")
        elif worker.status == WorkerStatus.IDLE:
            dispatch_on_commit(worker_id=worker.pk)
    return worker


def worker_set_labels(*, worker_id, labels, actor):
    """Replace the worker's labels (by the label rules, else InvalidInput ``invalid_labels``); return the worker.

    Queued jobs are matched again: an idle worker is offered the queue at once, and every queued job's
    waiting reason reads the new labels. Audited with both label sets; no change writes nothing.
    """
    labels = clean_worker_labels(labels)
    with audited_atomic():
        worker = lock_worker(worker_id)
        before = dict(worker.labels or {})
        if before == labels:
            return worker
        _worker_write(worker, action=actions.WORKER_LABELS_CHANGED, details={"from": before, "to": labels}, actor=actor, labels=labels)
        if worker.status == WorkerStatus.IDLE:
            dispatch_on_commit(worker_id=worker.pk)
    return worker
