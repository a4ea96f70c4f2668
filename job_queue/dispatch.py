"""Placing queued jobs on available workers: matching, assignment (a new attempt), and what the worker is sent."""

import functools
import itertools
import logging
import re
from urllib.parse import quote

from django.db import DatabaseError, connection, transaction
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
from common.updates import update_rows
from worker_agent import protocol
from workers import events as worker_events
from workers.models import OFFER_RANK_LOCAL, WORKER_ONLINE, Worker, WorkerStatus, WorkerType
from workers.streams import agent_key, serving_entry
from workers.transitions import worker_resting_status, workers_free, workers_transition

from . import events, fairshare, gangs, packing
from .limits import MATCHED_FIELDS, NO_ID, Held, LimitBook, any_limit, any_limit_at_dispatch, limit_applies, with_limits, within_limits
from .models import TARGET_WORKER_TYPES, Job, JobStatus, job_fits_worker, new_lease_id, targets_for_worker_type
from .transitions import attempt_open, jobs_give_back_gpus, jobs_transition

logger = logging.getLogger(__name__)

SYSTEM = Actor.system("dispatcher")
# Fields of a stored worker event that only the server reads (``realtime.streams`` takes them out before sending):
# the key (``workers.streams.agent_key``) of the agent a ``job_submit`` was dispatched to, which only that agent's
# streams deliver; and the streams a ``shutdown`` (``protocol.AGENT_REPLACED``) ends, which only they deliver.
TO_AGENT = "_to_agent"
REPLACED_STREAMS = "_replaced_streams"
FIRST_CANDIDATES = 8
CANDIDATE_BATCH = 200
# A job that waited for a held worker and lost it to another job may wait for the next held one: at most this often.
MAX_WAKE_UPS = 3


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
    payload = {
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
    if job.gpu_indices is not None and job.gpu_count:  # on a packing worker; absent, the job has the whole worker
        payload["gpu_indices"] = list(job.gpu_indices)
    return payload


def job_resume_payload(job) -> protocol.ResumeJob:
    """Return the ``resume_job`` object of a register response."""
    return {"job_id": job.pk, "status": job.status, "attempt": job.lease_id, "attempt_number": job.attempt_count}


def job_redeliver_on_commit(*, job_id, worker_id, to):
    """Re-send ``job_submit`` for a dispatch the worker has not acknowledged yet (same lease), to the agent ``to``."""
    job = Job.objects.filter(pk=job_id, status=JobStatus.DISPATCHED).first()
    if job is not None and job.num_nodes > 1:  # a member of a multi-node job that has not acknowledged: its own rank
        fields = gangs.member_submit_fields(job, worker_id)
        if fields is not None:
            worker_events.publish_on_commit(worker_id, protocol.JOB_SUBMIT, **job_submit_payload(job), **fields, **_to(to))
    elif job is not None and job.worker_id == worker_id:
        worker_events.publish_on_commit(worker_id, protocol.JOB_SUBMIT, **job_submit_payload(job), **_to(to))


def _to(agent):
    """The ``TO_AGENT`` field addressing a job_submit to ``agent`` (none for None: every stream delivers it)."""
    return {} if agent is None else {TO_AGENT: agent}


def _serving_agent(worker):
    """The key of the agent whose stream serves the locked ``worker``, or None (a stream opened before keys)."""
    entry = serving_entry(worker)
    return None if entry is None else agent_key(entry)


# --- assignment -----------------------------------------------------------------------------------


def _assign(*, job, worker, actor):
    now = timezone.now()
    lease = new_lease_id()
    number = job.attempt_count + 1
    placed, held = {"current_job": job, "gang_rank": 0}, {}
    if worker.packs:  # its GPUs, out of those its jobs leave free (one read of them, in this transaction)
        jobs = packing.held_jobs(worker.pk)
        held = {"gpu_indices": packing.allocate(worker, job, jobs), "holds_gpus": True}
        job.gpu_indices = held["gpu_indices"]  # (jobs_transition writes it too) counted by its worker's room below
        placed = {"gpus_free": packing.room(worker, [*jobs, job])}
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
        **held,
    )
    workers_transition(
        workers=[worker], to=WorkerStatus.BUSY, actor=actor, reason=f"dispatched job {job.pk}", now=now, **placed
    )
    attempt_open(job=job, worker=worker, lease_id=lease, number=number, now=now, gpu_indices=held.get("gpu_indices"))
    audit_record(
        actor=actor,
        action=actions.JOB_DISPATCHED,
        target_type="job",
        target_id=job.pk,
        details={"worker": worker.pk, "worker_name": worker.name, "attempt": number, "lease": lease, **({"gpu_indices": job.gpu_indices} if held else {})},
    )
    resume = job_resume_checkpoint(job)
    if resume is not None:
        artifact_services.attempt_steps_record(lease_id=lease, job_id=job.pk, start_step=resume["step"])
    worker_events.publish_on_commit(
        worker.pk, protocol.JOB_SUBMIT, **job_submit_payload(job, resume), **_to(_serving_agent(worker))
    )
    outbox.emit_on_commit(
        events.DISPATCHED, job_id=job.pk, attempt_number=number, submitted_at=job.submitted_at, dispatched_at=now
    )


def dispatch_gang(job, *, actor=SYSTEM):
    """Dispatch queued multi-node ``job`` (locked, or created, in the caller's audited transaction) to ``num_nodes``
    workers at once, or to none (``gangs.take_workers``); return rank 0's worker, or None.

    One attempt (one lease, one attempt number) for the whole gang; each member worker holds the job under its rank
    (a packing worker: on the lowest of its free GPUs, ``packing.allocate``, beside its jobs) and gets its own
    ``job_submit`` (rank 0's first) with the rendezvous: rank 0's address and a port from ``GANG_PORT_RANGE``
    (``gangs.master_port``), and on a packing worker the member's ``gpu_indices``."""
    if LimitBook(lock=True).hold(job, gpus=(job.gpu_count or 1) * job.num_nodes) is not None:
        fairshare.share_ensure(job)
        return None
    taken = gangs.take_workers(job)
    workers, held = taken if taken else ([], {})
    port = gangs.master_port(workers[0], avoid=job.master_port) if workers else None
    if port is None:
        fairshare.share_ensure(job)  # it waits in the queue: its share is probed for a freed worker
        return None
    rank0, now, lease, number = workers[0], timezone.now(), new_lease_id(), job.attempt_count + 1
    names = ", ".join(worker.name for worker in workers)
    jobs_transition(
        jobs=[job], to=JobStatus.DISPATCHED, actor=actor, reason=f"dispatched to {names} ({job.num_nodes} nodes)",
        worker=rank0, worker_name=rank0.name, lease_id=lease, attempt_count=number, dispatched_at=now, master_port=port,
    )
    indices = {}  # packing worker id -> the GPUs its member holds there
    for rank, worker in enumerate(workers):
        if worker.packs:  # its GPUs and a job slot, beside its jobs (held: read under its lock by take_workers)
            indices[worker.pk] = packing.allocate(worker, job, held[worker.pk])
            placed = {"gpus_free": packing.room(worker, [*held[worker.pk], _Holding(indices[worker.pk])])}
        else:
            placed = {"current_job": job, "gang_rank": rank}
        workers_transition(
            workers=[worker], to=WorkerStatus.BUSY, actor=actor, reason=f"dispatched job {job.pk} (rank {rank})", now=now,
            **placed,
        )
    attempt = attempt_open(job=job, worker=rank0, lease_id=lease, number=number, now=now)
    attempt.gpus = sum(job.gpu_count or worker.gpu_count for worker in workers)  # every member's, charged together
    attempt.save(update_fields=["gpus"])
    gangs.members_create(job=job, workers=workers, lease_id=lease, gpu_indices=indices)
    address = gangs.master_address(rank0)
    audit_record(
        actor=actor,
        action=actions.JOB_DISPATCHED,
        target_type="job",
        target_id=job.pk,
        details={
            "worker": rank0.pk, "worker_name": rank0.name, "attempt": number, "lease": lease,
            "members": [worker.pk for worker in workers], "master_addr": address, "master_port": port,
            **({"gpu_indices": {str(pk): value for pk, value in indices.items()}} if indices else {}),
        },
    )
    resume = job_resume_checkpoint(job)  # every member resumes from it
    if resume is not None:
        artifact_services.attempt_steps_record(lease_id=lease, job_id=job.pk, start_step=resume["step"])
    payload = job_submit_payload(job, resume)
    for rank, worker in enumerate(workers):
        fields = gangs.gang_fields(job, rank=rank, master_addr=address, gpu_indices=indices.get(worker.pk))
        worker_events.publish_on_commit(worker.pk, protocol.JOB_SUBMIT, **payload, **fields, **_to(_serving_agent(worker)))
    outbox.emit_on_commit(
        events.DISPATCHED, job_id=job.pk, attempt_number=number, submitted_at=job.submitted_at, dispatched_at=now
    )
    return rank0


class _Holding:
    """The GPUs ``gpu_indices`` a member just placed on a packing worker holds there (what ``packing.room`` counts)."""

    def __init__(self, gpu_indices):
        self.gpu_indices = gpu_indices


def dispatch_gangs(*, actor=SYSTEM):
    """Offer the free workers to the queued multi-node jobs, in the queue's order; return how many were dispatched.
    Each is tried in its own transaction (``dispatch_for_job``)."""
    queued = Job.objects.filter(status=JobStatus.QUEUED, num_nodes__gt=1).order_by("-priority", "submitted_at", "pk")
    return sum(dispatch_for_job(job_id, actor=actor) is not None for job_id in list(queued.values_list("pk", flat=True)[:100]))


def _gangs_on_commit():
    """Offer the free workers to the queued multi-node jobs once committed, if any is queued (one index read)."""
    if Job.objects.filter(status=JobStatus.QUEUED, num_nodes__gt=1).exists():
        transaction.on_commit(dispatch_gangs, robust=True)


def _available_workers():
    return Worker.objects.filter(status=WorkerStatus.IDLE, current_job__isnull=True, stream_id__isnull=False)


# At most one row (by primary key): no ORDER BY. Compiled once: a dispatch runs it for each candidate it tries.
_LOCK_AVAILABLE_WORKER = PreparedQuery(
    lambda *, pk: _available_workers().select_for_update(skip_locked=True).filter(pk=pk)[:1]
)


# The same row, with whether a running or GPU limit is set anywhere (``dispatch_for_worker``).
_LOCK_OFFERED_WORKER = PreparedQuery(
    lambda *, pk: _available_workers().annotate(any_limit=any_limit()).select_for_update(skip_locked=True).filter(pk=pk)[:1]
)

# The same row, waiting for a transaction that holds it (``_dispatch_when_released``).
_LOCK_AVAILABLE_WORKER_WAITING = PreparedQuery(lambda *, pk: _available_workers().select_for_update().filter(pk=pk)[:1])


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


def _packing_workers():
    """Busy packing workers with room for a job beside theirs (draining ones are ``draining``, not busy)."""
    return Worker.objects.filter(status=WorkerStatus.BUSY, gpus_free__gt=0, stream_id__isnull=False)


def _offered_workers(target, label_keys, *, gpu_count, packed=False, **labels):
    """The available workers that may take a job of ``target`` needing ``gpu_count`` GPUs, whose label
    ``label_keys[i]`` is the text ``labels[f"label_{i}"]``, in the order they are offered it: remote before
    local, then least recently finished first. ``packed``: the busy packing workers with ``gpu_count`` free GPUs
    instead, fullest first (best fit: whole workers stay free for jobs that need them), from the index
    ``worker_packing_offer``."""
    workers = _packing_workers() if packed else _available_workers()
    for i, key in enumerate(label_keys):
        label = Cast(KeyTextTransform(key, "labels"), output_field=TextField())
        workers = workers.alias(**{f"label_{i}": label}).filter(**{f"label_{i}": labels[f"label_{i}"]})
    types = TARGET_WORKER_TYPES[target]
    if packed:
        return workers.filter(worker_type__in=types, gpus_free__gte=gpu_count).order_by("status", "gpus_free", "pk")
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


def _packing_workers_for_job(target, label_keys, start, stop, *, gpu_count, **labels):
    """Rows ``start:stop`` of the busy packing workers ``_offered_workers`` offers, as much of each as matching needs."""
    workers = _offered_workers(target, label_keys, gpu_count=gpu_count, packed=True, **labels)
    return workers.only("pk", "labels", "gpu_count", "gpus_free")[start:stop]


def _first_worker_for_job(target, label_keys, *, gpu_count, packed=False, limit_team=NO_ID, limit_user=NO_ID, **labels):
    """The first of ``_offered_workers`` that no other transaction holds, locked (SKIP LOCKED), with ``limited``:
    whether a running or GPU limit applies to the job (of team ``limit_team``, submitter ``limit_user``)."""
    return (
        _offered_workers(target, label_keys, gpu_count=gpu_count, packed=packed, **labels)
        .annotate(limited=limit_applies(team_id=limit_team, user_id=limit_user))
        .select_for_update(skip_locked=True)[:1]
    )


def _first_packing_worker_for_job(target, label_keys, *, gpu_count, limit_team=NO_ID, limit_user=NO_ID, **labels):
    """``_first_worker_for_job`` among the busy packing workers with room."""
    return _first_worker_for_job(
        target, label_keys, gpu_count=gpu_count, packed=True, limit_team=limit_team, limit_user=limit_user, **labels
    )


def _offered_jobs(worker_type, *, gpu_count, packed=False):
    """The queued jobs a worker of ``worker_type`` with ``gpu_count`` GPUs may run, highest priority then oldest first
    (fair share aside: the candidates behind the shares' heads, ``fairshare.offered_jobs``). ``packed``: beside
    a busy packing worker's jobs, so only jobs that need GPUs (one that needs 0 takes a whole worker)."""
    jobs = Job.objects.filter(
        status=JobStatus.QUEUED, target__in=targets_for_worker_type(worker_type), gpu_count__lte=gpu_count
    )
    if packed:
        jobs = jobs.filter(gpu_count__gte=1)
    return jobs.order_by("-priority", "submitted_at", "pk")


def _jobs_for_worker(worker_type, start, stop, *, gpu_count):
    """Rows ``start:stop`` of ``_offered_jobs``, as much of each as matching needs."""
    return with_limits(_offered_jobs(worker_type, gpu_count=gpu_count).only(*MATCHED_FIELDS))[start:stop]


def _jobs_beside(worker_type, start, stop, *, gpu_count):
    """Rows ``start:stop`` of the jobs ``_offered_jobs`` offers a busy packing worker with ``gpu_count`` GPUs free."""
    return with_limits(_offered_jobs(worker_type, gpu_count=gpu_count, packed=True).only(*MATCHED_FIELDS))[start:stop]


def _first_job_for_worker(worker_type, *, gpu_count):
    """The first of ``_offered_jobs`` that no other transaction holds, locked (SKIP LOCKED)."""
    return with_limits(_offered_jobs(worker_type, gpu_count=gpu_count)).select_for_update(skip_locked=True, of=("self",))[:1]


# Compiled once per shape (a job's target and exact label keys; a worker's type): every dispatch reads them.
_WORKERS_FOR_JOB = PreparedQuery(_workers_for_job)
_JOBS_FOR_WORKER = PreparedQuery(_jobs_for_worker)
_HEADS_FOR_WORKER = PreparedQuery(fairshare.heads_for_worker)
_FIRST_WORKER_FOR_JOB = PreparedQuery(_first_worker_for_job)
_FIRST_JOB_FOR_WORKER = PreparedQuery(_first_job_for_worker)
_FIRST_HEAD_FOR_WORKER = PreparedQuery(fairshare.first_head_for_worker)
_PACKING_WORKERS_FOR_JOB = PreparedQuery(_packing_workers_for_job)
_FIRST_PACKING_WORKER_FOR_JOB = PreparedQuery(_first_packing_worker_for_job)
_JOBS_BESIDE = PreparedQuery(_jobs_beside)
# A busy packing worker, locked by primary key (SKIP LOCKED) to take a job beside its own.
_LOCK_PACKING_WORKER = PreparedQuery(lambda *, pk: _packing_workers().select_for_update(skip_locked=True).filter(pk=pk)[:1])
_LOCK_PACKING_WORKER_WAITING = PreparedQuery(lambda *, pk: _packing_workers().select_for_update().filter(pk=pk)[:1])


def _lock_packing_worker(worker_id):
    return _LOCK_PACKING_WORKER.first(pk=str(worker_id))


def dispatch_locked_job(job, *, actor=SYSTEM, wake_ups=MAX_WAKE_UPS):
    """Dispatch queued ``job``, locked by (or created in) the caller's audited transaction; return the worker or None.

    As ``dispatch_for_job``, in the caller's transaction: a submit creates its job and dispatches it
    in one commit. ``job`` is updated in place. None because a worker that fits is held by another
    transaction: the job waits for that worker once the caller commits (``_wake_up_on_commit``).
    """
    if job.num_nodes > 1:
        return dispatch_gang(job, actor=actor)
    exact = _exact_labels(job.worker_labels)
    labels = {f"label_{i}": text for i, text in enumerate(exact.values())}
    shape, values = (job.target, tuple(exact)), {"gpu_count": job.gpu_count, **labels}
    # The first worker offered, read and locked in one statement, nearly always takes the job (the labels
    # without globs are matched in SQL). None: every worker that could is taken or held by another dispatch.
    # It says whether a running or GPU limit applies to the job: only then are the limits read.
    limited_to = {"limit_team": job.team_id or NO_ID, "limit_user": job.submitted_by_id or NO_ID}
    first = _FIRST_WORKER_FOR_JOB.first(*shape, **values, **limited_to)
    book = LimitBook(lock=True) if first is not None and first.limited else None
    try:
        worker = _first_fit(
            first,
            _candidates(_WORKERS_FOR_JOB, *shape, **values),  # a generator: read only if needed
            fits=lambda worker: job_fits_worker(job, worker) and within_limits(book, job, worker),
            lock=_lock_available_worker,
            assign=lambda worker: _assign(job=job, worker=worker, actor=actor),
        )
        if worker is None and job.gpu_count:
            # No idle worker takes it: a busy packing worker with its GPUs free may (one index read; none on a
            # fleet that does not pack, whose busy workers all have gpus_free 0).
            first = _FIRST_PACKING_WORKER_FOR_JOB.first(*shape, **values, **limited_to)
            book = book or (LimitBook(lock=True) if first is not None and first.limited else None)
            worker = _first_fit(
                first,
                _candidates(_PACKING_WORKERS_FOR_JOB, *shape, **values),
                fits=lambda worker: packing.job_fits_packed(job, worker) and within_limits(book, job, worker),
                lock=_lock_packing_worker,
                assign=lambda worker: _assign(job=job, worker=worker, actor=actor),
            )
    except Held:
        worker = None
    if worker is None:
        fairshare.share_ensure(job)  # it waits in the queue: its share is probed for a freed worker
        if book is None and wake_ups > 0 and connection.features.has_select_for_update_skip_locked:
            _wake_up_on_commit(job, shape, values, wake_ups=wake_ups)
    return worker


def _wake_up_on_commit(job, shape, values, *, wake_ups):
    """Make sure ``job``, which found no worker it could lock, is not left waiting while a held worker frees up.

    SKIP LOCKED passes over a worker another transaction holds. When that transaction is the worker's
    own offer of the queue (it was freed, or its stream opened), it read the queue before this job
    committed and finds nothing: both commit empty-handed and the job would wait for the periodic
    ``dispatch_pending``. So when a fitting worker is idle as last committed (one read of the offer
    index, made only when no worker was found), the job waits for that worker's row once this
    transaction commits (``_dispatch_when_released``); a busy fleet finds none and waits for nothing.
    """
    held = next((w.pk for w in _WORKERS_FOR_JOB.run(*shape, 0, FIRST_CANDIDATES, **values) if job_fits_worker(job, w)), None)
    packed = False
    if held is None and job.gpu_count:  # a busy packing worker with room, held by a report or heartbeat of its agent
        rows = _PACKING_WORKERS_FOR_JOB.run(*shape, 0, FIRST_CANDIDATES, **values)
        held, packed = next((w.pk for w in rows if packing.job_fits_packed(job, w)), None), True
    if held is not None:
        transaction.on_commit(
            functools.partial(_dispatch_when_released, job.pk, held, wake_ups=wake_ups - 1, packed=packed), robust=True
        )


def _dispatch_when_released(job_id, worker_id, *, wake_ups, packed=False):
    """Dispatch queued job ``job_id`` to ``worker_id`` (``packed``: a busy packing worker with room) once the
    transaction holding the worker commits.

    The worker's row is its first lock, taken waiting (it holds nothing while it waits), and the job's is
    taken with SKIP LOCKED: it cannot close a cycle of waits. If the worker was taken meanwhile, the job
    tries the others as any dispatch does.
    """
    with audited_atomic():
        waiting = _LOCK_PACKING_WORKER_WAITING if packed else _LOCK_AVAILABLE_WORKER_WAITING
        worker = waiting.first(pk=str(worker_id))
        job = _lock_queued_job(job_id)
        if job is None:  # dispatched, cancelled, or being dispatched by another transaction
            return None
        matches = packing.job_fits_packed if packed else job_fits_worker
        fits = worker is not None and worker.drain_requested_at is None and matches(job, worker)
        if fits and LimitBook(lock=True).hold(job, gpus=job.gpu_count or worker.gpu_count) is None:
            _assign(job=job, worker=worker, actor=SYSTEM)
            return worker
        return dispatch_locked_job(job, wake_ups=wake_ups)


def dispatch_for_worker(worker_id, *, actor=SYSTEM, freed=False, beside=False):
    """Give available worker ``worker_id`` the first queued job it fits in fair order (priority first) that no limit
    holds back; return it or None. A packing worker is offered more while it has room (``fill_packing_worker``);
    ``beside``: the worker is a busy packing worker with room, offered jobs beside its own.

    ``freed``: its job just ended. When a running or GPU limit is set, the room that job leaves may let a job
    held back run on another idle worker: the queue is offered to the idle workers once committed."""
    with audited_atomic():
        if beside:
            worker = _LOCK_PACKING_WORKER_WAITING.first(pk=str(worker_id))  # waits out a report or heartbeat
            placed = [] if worker is None or worker.drain_requested_at is not None else fill_packing_worker(worker, actor=actor)
            if worker is not None and worker.multi_node and worker.gpus_free and worker.drain_requested_at is None:
                _gangs_on_commit()  # the room left may take a member of a multi-node job
            return placed[0] if placed else None
        worker = _LOCK_OFFERED_WORKER.first(pk=str(worker_id))
        job = None if worker is None or worker.drain_requested_at is not None else _offer_locked_worker(worker, actor=actor)
        if job is not None and worker.packs:
            fill_packing_worker(worker, actor=actor)
        if worker is not None and worker.multi_node and (job is None or worker.packs and worker.gpus_free):
            _gangs_on_commit()  # a freed worker takes no multi-node job itself: the gangs are offered the fleet
        if freed and (any_limit_at_dispatch() if worker is None else worker.any_limit):
            transaction.on_commit(functools.partial(dispatch_pending, limited_only=True), robust=True)
        return job


def fill_packing_worker(worker, *, actor=SYSTEM):
    """Offer locked, busy packing ``worker`` the queue while it has room (its ``gpus_free``, kept by each
    dispatch), in fair order; return the jobs placed on it. Each job placed takes a GPU at least: it ends."""
    placed = []
    while worker.status == WorkerStatus.BUSY and worker.gpus_free > 0 and worker.drain_requested_at is None:
        job = _offer_locked_worker(worker, actor=actor, beside=True)
        if job is None:
            break
        placed.append(job)
    return placed


def _offer_locked_worker(worker, *, actor, beside=False):
    """Give locked, available ``worker`` the first queued job it fits in fair order that no limit holds back.
    Return the job, or None. ``beside``: a busy packing worker, offered the jobs that fit its free GPUs.

    The first job offered, the best of the shares' heads, read and locked in one statement, nearly always
    fits. Else the heads in fair order, then every queued job the worker may run in priority order, are tried."""
    kind, gpus = worker.worker_type, worker.gpus_free if beside else worker.gpu_count
    first = _FIRST_HEAD_FOR_WORKER.first(kind, gpu_count=gpus)
    if first is None:  # no share's head (a share without its row yet: fairshare.shares_ensure_queued)
        first = _FIRST_JOB_FOR_WORKER.first(kind, gpu_count=gpus)
    if first is None:
        return None
    book = LimitBook(lock=True)  # read only for a job a limit applies to (``limited``)
    matches = packing.job_fits_packed if beside else job_fits_worker

    def fits(job):
        if not matches(job, worker):
            return False
        return not job.limited or book.hold(job, gpus=job.gpu_count or gpus) is None

    candidates = itertools.chain(
        _candidates(_HEADS_FOR_WORKER, kind, gpu_count=gpus),
        _candidates(_JOBS_BESIDE if beside else _JOBS_FOR_WORKER, kind, gpu_count=gpus),
    )
    job = _first_fit(first, candidates, fits=fits, lock=_lock_queued_job, assign=lambda job: _assign(job=job, worker=worker, actor=actor))
    return job


def _room_anywhere():
    """Whether any worker can take a job now: an available one, or a busy packing worker with free GPUs (one read)."""
    return (_available_workers() | _packing_workers()).exists()


def dispatch_pending(*, limit=1000, actor=SYSTEM, limited_only=False):
    """Dispatch queued jobs in fair order (priority first) while workers are available; return how many went out.
    ``limited_only``: only the jobs a running or GPU limit applies to (the room a job's end freed)."""
    dispatched = 0
    if not _room_anywhere():
        return 0
    queued = Job.objects.filter(status=JobStatus.QUEUED)
    if limited_only:
        queued = queued.filter(limit_applies())
    queued = (
        queued.annotate(share_usage=fairshare.share_usage())
        .order_by(*fairshare.fair_order())
        .only("pk", "gpu_count", "team_id", "submitted_by_id")[:limit]
    )
    seen = LimitBook(lock=False)  # as the pass began: a job it says is held is not tried (no statement)
    for job in list(queued):
        if seen.hold(job, gpus=job.gpu_count) is not None:
            continue
        if dispatch_for_job(job.pk, actor=actor) is not None:
            dispatched += 1
            if not _room_anywhere():
                break
    return dispatched


def dispatch_on_commit(*, worker_id=None, job_id=None, beside=False):
    """After the current transaction commits, try to dispatch for ``worker_id`` (``beside``: a busy packing worker
    with room) or ``job_id``."""

    def _run():
        if worker_id is not None:
            dispatch_for_worker(worker_id, beside=beside)
        if job_id is not None:
            dispatch_for_job(job_id)

    transaction.on_commit(_run, robust=True)


def worker_rest_and_offer(*, worker, actor, reason, busy=None, **fields):
    """Move the locked, live ``worker`` to its resting status, writing ``fields``; offer it the queue if idle.

    Resting is draining if a drain is requested, else busy (``busy``, by default: it holds a job), else
    idle; an idle worker is offered the queue once the caller's transaction commits. Return the worker.
    """
    if worker.packs and "gpus_free" not in fields:  # its room, from the jobs it holds (one read)
        held = packing.held_jobs(worker.pk)
        fields["gpus_free"] = packing.room(worker, held)
        busy = bool(held) if busy is None else busy
    busy = worker.current_job_id is not None if busy is None else busy
    workers_transition(workers=[worker], to=worker_resting_status(worker, busy=busy), actor=actor, reason=reason, **fields)
    _offer_on_commit(worker)
    return worker


def _offer_on_commit(worker):
    """Offer resting ``worker`` the queue once committed: idle, or a busy packing worker with free GPUs."""
    if worker.status == WorkerStatus.IDLE:
        dispatch_on_commit(worker_id=worker.pk)
    elif worker.status == WorkerStatus.BUSY and worker.packs and worker.gpus_free:
        dispatch_on_commit(worker_id=worker.pk, beside=True)


def worker_holds(worker, job):
    """Whether locked ``worker`` holds ``job`` (its ``current_job``; on a packing worker, a job or a gang member on its
    GPUs: ``packing.holds``)."""
    if worker.packs:
        return packing.holds(worker, job)
    return worker.current_job_id == job.pk


def worker_jobs_over(*, worker, job_ids, actor, reason, at_once=True):
    """The jobs ``job_ids`` that locked ``worker`` held (``worker_holds``, read before they changed) are over on it
    (ended, requeued, their cancel confirmed): free the worker of them and offer it work.

    A worker that does not pack is freed (``workers_free_and_offer``). A packing worker's jobs give their GPUs
    back, its ``gpus_free`` is recomputed from the jobs it still holds, and it rests: busy while it holds any,
    else idle (or draining); an offline one only loses them. It is offered the queue as a freed worker is."""
    if not worker.packs:
        workers_free_and_offer(workers=[worker], actor=actor, reason=reason, at_once=at_once)
        return
    packing_workers_recount(workers=[worker], job_ids=job_ids, actor=actor, reason=reason)
    if worker.worker_type == WorkerType.EPHEMERAL or worker.status not in (WorkerStatus.IDLE, WorkerStatus.BUSY):
        return
    if worker.multi_node and worker.gpus_free and worker.drain_requested_at is None:
        _gangs_on_commit()  # the room freed may take a member of a queued multi-node job
    if not at_once:
        _offer_on_commit(worker)
        return
    try:
        with audited_atomic():  # a savepoint of the caller's transaction
            if worker.status == WorkerStatus.IDLE:
                _offer_freed(worker, actor=actor)
            else:
                fill_packing_worker(worker, actor=actor)
    except DatabaseError:
        logger.exception("dispatch to freed packing worker %s failed; retried after the commit", worker.pk)
        _offer_on_commit(worker)


def packing_workers_recount(*, workers, job_ids, actor, reason, now=None):
    """The jobs ``job_ids`` left locked packing ``workers`` (or were taken back from them): they give their GPUs
    back; each worker's ``gpus_free`` is recounted from the jobs it still holds and the online ones rest, busy
    while they hold any, else idle (or draining). Set-based: one read of the jobs held, one UPDATE of the rooms,
    one status transition, whatever the number of workers. The caller offers them work."""
    now = now or timezone.now()
    if job_ids:
        jobs_give_back_gpus(job_ids=job_ids, worker_ids=[w.pk for w in workers])
    held = packing.held_by([w.pk for w in workers])
    rooms = {w.pk: {"gpus_free": packing.room(w, held[w.pk]), "last_job_finished_at": now} for w in workers}
    update_rows(Worker.objects, rooms)
    for worker in workers:
        for name, value in rooms[worker.pk].items():
            setattr(worker, name, value)
    online = [w for w in workers if w.status in WORKER_ONLINE]
    if online:
        rest = lambda w: worker_resting_status(w, busy=bool(held[w.pk]))  # noqa: E731
        workers_transition(workers=online, to=rest, actor=actor, reason=reason, now=now)
    return workers


def _offer_freed(worker, *, actor):
    """Offer locked, idle packing ``worker`` the queue: a first job, then more while it has room."""
    if _offer_locked_worker(worker, actor=actor) is not None:
        fill_packing_worker(worker, actor=actor)


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
            dispatch_for_worker(worker.pk, freed=True)  # its audited_atomic is a savepoint of the caller's transaction
        except DatabaseError:
            logger.exception("dispatch to freed worker %s failed; retried after the commit", worker.pk)
            dispatch_on_commit(worker_id=worker.pk)
