"""Placing queued jobs on available workers: matching, assignment (a new attempt), and what the worker is sent."""

import logging
import re
from urllib.parse import quote

from django.db import DatabaseError, transaction
from django.db.models import TextField
from django.db.models.functions import Cast
from django.db.models.fields.json import KeyTextTransform
from django.utils import timezone

from artifacts import selectors as artifact_selectors
from artifacts import services as artifact_services
from artifacts import tokens as artifact_tokens
from audit import actions
from audit.services import Actor, audit_record, audited_atomic
from common import outbox
from common.prepared import PreparedQuery
from worker_agent import protocol
from workers import events as worker_events
from workers.models import OFFER_RANK_LOCAL, Worker, WorkerStatus, WorkerType
from workers.transitions import workers_free, workers_transition

from . import events
from .models import TARGET_WORKER_TYPES, Job, JobStatus, job_fits_worker, new_lease_id, targets_for_worker_type
from .transitions import attempt_open, jobs_transition

logger = logging.getLogger(__name__)

SYSTEM = Actor.system("dispatcher")
FIRST_CANDIDATES = 8
CANDIDATE_BATCH = 200


# --- what a worker is sent ------------------------------------------------------------------------


def job_resume_checkpoint(job) -> protocol.ResumeCheckpoint | None:
    """Return the checkpoint the job's current attempt resumes from (the latest complete one), each file
    with the URL the attempt downloads it from with its own upload token; or None (always, for a first
    attempt: no attempt before it wrote one, and no query is made)."""
    if job.attempt_count <= 1:
        return None
    resume = artifact_selectors.resume_checkpoint(job.pk)
    if resume is not None:
        for item in resume["files"]:
            item["download_url"] = f"{protocol.UPLOAD_PATH}/{quote(item['key'])}"
    return resume


_NOT_LOOKED_UP = object()


def job_submit_payload(job, resume=_NOT_LOOKED_UP):
    """Return the ``job_submit`` event data (without its ``type``) for the job's current attempt.

    ``resume`` is ``job_resume_checkpoint(job)`` when the caller has it already (None included).
    """
    return {
        "job_id": job.pk,
        "config_name": job.config_name,
        "config": job.config,
        "dataloader": job.dataloader,
        "upload_endpoint": protocol.UPLOAD_PATH,
        "upload_token": artifact_tokens.upload_token(job.lease_id),
        "attempt": job.lease_id,
        "attempt_number": job.attempt_count,
        "resume": job_resume_checkpoint(job) if resume is _NOT_LOOKED_UP else resume,
    }


def job_resume_payload(job) -> protocol.ResumeJob:
    """Return the ``resume_job`` object of a register response."""
    return {"job_id": job.pk, "status": job.status, "attempt": job.lease_id, "attempt_number": job.attempt_count}


def job_redeliver_on_commit(*, job_id, worker_id):
    """Re-send ``job_submit`` for a dispatch the worker has not acknowledged yet (same lease)."""
    job = Job.objects.filter(pk=job_id, worker_id=worker_id, status=JobStatus.DISPATCHED).first()
    if job is not None:
        worker_events.publish_on_commit(worker_id, protocol.JOB_SUBMIT, **job_submit_payload(job))


# --- assignment -----------------------------------------------------------------------------------


def _assign(*, job, worker, actor):
    now = timezone.now()
    lease = new_lease_id()
    number = job.attempt_count + 1
    jobs_transition(
        jobs=[job],
        to=JobStatus.DISPATCHED,
        actor=actor,
        reason=f"dispatched to {worker.name}",
        worker=worker,
        worker_name=worker.name,
        lease_id=lease,
        attempt_count=number,
        dispatched_at=now,
    )
    workers_transition(
        workers=[worker], to=WorkerStatus.BUSY, actor=actor, reason=f"dispatched job {job.pk}", current_job=job, now=now
    )
    attempt_open(job=job, worker=worker, lease_id=lease, number=number, now=now)
    audit_record(
        actor=actor,
        action=actions.JOB_DISPATCHED,
        target_type="job",
        target_id=job.pk,
        details={"worker": worker.pk, "worker_name": worker.name, "attempt": number, "lease": lease},
    )
    resume = job_resume_checkpoint(job)
    if resume is not None:
        artifact_services.attempt_steps_record(lease_id=lease, job_id=job.pk, start_step=resume["step"])
    worker_events.publish_on_commit(worker.pk, protocol.JOB_SUBMIT, **job_submit_payload(job, resume))
    outbox.emit_on_commit(
        events.DISPATCHED, job_id=job.pk, attempt_number=number, submitted_at=job.submitted_at, dispatched_at=now
    )


def _available_workers():
    return Worker.objects.filter(status=WorkerStatus.IDLE, current_job__isnull=True, stream_id__isnull=False)


# At most one row (by primary key): no ORDER BY. Compiled once: a dispatch runs it for each candidate it tries.
_LOCK_AVAILABLE_WORKER = PreparedQuery(
    lambda *, pk: _available_workers().select_for_update(skip_locked=True).filter(pk=pk)[:1]
)


def _lock_available_worker(worker_id):
    return _LOCK_AVAILABLE_WORKER.first(pk=str(worker_id))


_LOCK_QUEUED_JOB = PreparedQuery(
    lambda *, pk: Job.objects.select_for_update(skip_locked=True).filter(pk=pk, status=JobStatus.QUEUED)[:1]
)


def _lock_queued_job(job_id):
    """Return queued job ``job_id`` locked for update, or None (not queued, or locked by another dispatch)."""
    return _LOCK_QUEUED_JOB.first(pk=str(job_id))


def dispatch_for_job(job_id, *, actor=SYSTEM):
    """Dispatch queued job ``job_id`` to the best available worker; return the worker or None.

    Workers that fit are tried least-recently-used first (remote before local for ``auto``); a worker
    taken concurrently is skipped. Never dispatches a job twice nor gives a worker two jobs.
    """
    with audited_atomic():
        job = _lock_queued_job(job_id)
        if job is None:
            return None
        return dispatch_locked_job(job, actor=actor)


def _candidates(rows, *shape, **values):
    """Yield the rows of the prepared query ``rows`` (its shape ``shape`` then a ``start, stop`` window): the first
    FIRST_CANDIDATES from one small query (the first nearly always takes the job: labels are pre-filtered in
    SQL), then up to CANDIDATE_BATCH from a second, and past that the rest through a cursor (on PostgreSQL a
    server-side cursor costs a DECLARE, a FETCH and a CLOSE).

    With a fleet of idle workers, reading 200 rows at once hydrated 200 workers to take the first of them."""
    first = rows.run(*shape, 0, FIRST_CANDIDATES, **values)
    yield from first
    if len(first) < FIRST_CANDIDATES:
        return
    batch = rows.run(*shape, FIRST_CANDIDATES, CANDIDATE_BATCH, **values)
    yield from batch
    if len(batch) == CANDIDATE_BATCH - FIRST_CANDIDATES:
        seen = {row.pk for row in first} | {row.pk for row in batch}
        everything = rows.build(*shape, 0, None, **values)
        yield from (row for row in everything.iterator(chunk_size=CANDIDATE_BATCH) if row.pk not in seen)


def _first_fit(first, candidates, *, fits, lock, assign):
    """Return the match made, after ``assign``-ing it: ``first`` (read and locked already) when it ``fits``,
    else the first of ``candidates`` that ``fits`` and that ``lock`` (by pk) still finds available; None when
    ``first`` is None or none of them is left. Dispatch matches a job to workers and a worker to jobs alike."""
    if first is None:
        return None
    if fits(first):
        assign(first)
        return first
    for candidate in candidates:
        if not fits(candidate):
            continue
        locked = lock(candidate.pk)
        if locked is None:
            continue
        assign(locked)
        return locked
    return None


_GLOB = re.compile(r"[*?\[]")


def _exact_labels(selectors):
    """Return ``{key: text}`` of the selectors holding no glob character: ``labels_match`` compares those to the
    worker's label as plain, case-sensitive text, so they pre-filter in SQL; the match itself stays ``job_fits_worker``."""
    return {key: str(value) for key, value in (selectors or {}).items() if not _GLOB.search(str(value))}


def _offered_workers(target, label_keys, *, gpu_count, **labels):
    """The available workers that may take a job of ``target`` needing ``gpu_count`` GPUs, whose label
    ``label_keys[i]`` is the text ``labels[f"label_{i}"]``, in the order they are offered it: remote before
    local, then least recently finished first."""
    workers = _available_workers()
    for i, key in enumerate(label_keys):
        label = Cast(KeyTextTransform(key, "labels"), output_field=TextField())
        workers = workers.alias(**{f"label_{i}": label}).filter(**{f"label_{i}": labels[f"label_{i}"]})
    types = TARGET_WORKER_TYPES[target]
    if WorkerType.LOCAL not in types:  # the ranks' range too, so the index scan starts and stops where they do
        workers = workers.filter(offer_rank__lt=OFFER_RANK_LOCAL)
    elif len(types) == 1:
        workers = workers.filter(offer_rank__gte=OFFER_RANK_LOCAL)
    # Worker.offer_rank: remote before local, the never-finished first; then least recently finished. The
    # status and the job are the same for every row (idle, none): ordering by them too follows the
    # index worker_offer_order column for column, so the first row is read from it, not from a sort of the
    # fleet (a local-only job's few workers, found by their rank range, the planner may still sort).
    return workers.filter(worker_type__in=types, gpu_count__gte=gpu_count).order_by(
        "status", "current_job_id", "offer_rank", "last_job_finished_at", "pk"
    )


def _workers_for_job(target, label_keys, start, stop, *, gpu_count, **labels):
    """Rows ``start:stop`` of ``_offered_workers``, as much of each as matching needs."""
    return _offered_workers(target, label_keys, gpu_count=gpu_count, **labels).only("pk", "labels", "gpu_count")[start:stop]


def _first_worker_for_job(target, label_keys, *, gpu_count, **labels):
    """The first of ``_offered_workers`` that no other transaction holds, locked (SKIP LOCKED)."""
    return _offered_workers(target, label_keys, gpu_count=gpu_count, **labels).select_for_update(skip_locked=True)[:1]


def _offered_jobs(worker_type, *, gpu_count):
    """The queued jobs a worker of ``worker_type`` with ``gpu_count`` GPUs may run, highest priority then oldest first."""
    return Job.objects.filter(
        status=JobStatus.QUEUED, target__in=targets_for_worker_type(worker_type), gpu_count__lte=gpu_count
    ).order_by("-priority", "submitted_at", "pk")


def _jobs_for_worker(worker_type, start, stop, *, gpu_count):
    """Rows ``start:stop`` of ``_offered_jobs``, as much of each as matching needs."""
    return _offered_jobs(worker_type, gpu_count=gpu_count).only("pk", "worker_labels", "gpu_count")[start:stop]


def _first_job_for_worker(worker_type, *, gpu_count):
    """The first of ``_offered_jobs`` that no other transaction holds, locked (SKIP LOCKED)."""
    return _offered_jobs(worker_type, gpu_count=gpu_count).select_for_update(skip_locked=True)[:1]


# Compiled once per shape (a job's target and exact label keys; a worker's type): every dispatch reads them.
_WORKERS_FOR_JOB = PreparedQuery(_workers_for_job)
_JOBS_FOR_WORKER = PreparedQuery(_jobs_for_worker)
_FIRST_WORKER_FOR_JOB = PreparedQuery(_first_worker_for_job)
_FIRST_JOB_FOR_WORKER = PreparedQuery(_first_job_for_worker)


def dispatch_locked_job(job, *, actor=SYSTEM):
    """Dispatch queued ``job``, locked by (or created in) the caller's audited transaction; return the worker or None.

    As ``dispatch_for_job``, in the caller's transaction: a submit creates its job and dispatches it
    in one commit. ``job`` is updated in place.
    """
    exact = _exact_labels(job.worker_labels)
    labels = {f"label_{i}": text for i, text in enumerate(exact.values())}
    # The first worker offered, read and locked in one statement, nearly always takes the job (the labels
    # without globs are matched in SQL). None: every worker that could is taken or held by another dispatch.
    return _first_fit(
        _FIRST_WORKER_FOR_JOB.first(job.target, tuple(exact), gpu_count=job.gpu_count, **labels),
        _candidates(_WORKERS_FOR_JOB, job.target, tuple(exact), gpu_count=job.gpu_count, **labels),  # a generator: read only if needed
        fits=lambda worker: job_fits_worker(job, worker),
        lock=_lock_available_worker,
        assign=lambda worker: _assign(job=job, worker=worker, actor=actor),
    )


def dispatch_for_worker(worker_id, *, actor=SYSTEM):
    """Give available worker ``worker_id`` the highest-priority, oldest queued job it fits; return it or None."""
    with audited_atomic():
        worker = _lock_available_worker(worker_id)
        if worker is None or worker.drain_requested_at is not None:
            return None
        # As for a job: the first job offered, read and locked in one statement, nearly always fits.
        return _first_fit(
            _FIRST_JOB_FOR_WORKER.first(worker.worker_type, gpu_count=worker.gpu_count),
            _candidates(_JOBS_FOR_WORKER, worker.worker_type, gpu_count=worker.gpu_count),
            fits=lambda job: job_fits_worker(job, worker),
            lock=_lock_queued_job,
            assign=lambda job: _assign(job=job, worker=worker, actor=actor),
        )


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


def redispatch_on_commit(released):
    """Offer the jobs ``jobs_release`` put back on the queue to workers once committed (one: at once; more: in order)."""
    if len(released.requeued) == 1:
        dispatch_on_commit(job_id=released.requeued[0])
    elif released.requeued:
        transaction.on_commit(dispatch_pending, robust=True)


def workers_free_and_offer(*, workers, actor, reason, at_once=True):
    """Free locked ``workers`` whose job is over (``workers.transitions.workers_free``) and offer work to the idle.

    With ``at_once`` the offer is made in the caller's (audited) transaction: the end of one job and the
    dispatch of the next commit together, one commit instead of two per job. It locks no row it could
    wait for (the worker is locked already; queued jobs are taken with SKIP LOCKED), so it adds no
    lock-order hazard. Should it fail, its savepoint rolls back and the offer is made after the commit
    instead, as it is without ``at_once``.
    An ephemeral agent leaves after its job; it gets another only by asking (the queue endpoint).
    """
    for worker in workers_free(workers=workers, actor=actor, reason=reason):
        if worker.worker_type == WorkerType.EPHEMERAL:
            continue
        if not at_once:
            dispatch_on_commit(worker_id=worker.pk)
            continue
        try:
            dispatch_for_worker(worker.pk)  # its audited_atomic is a savepoint of the caller's transaction
        except DatabaseError:
            logger.exception("dispatch to freed worker %s failed; retried after the commit", worker.pk)
            dispatch_on_commit(worker_id=worker.pk)
