"""Jobs across machines (gangs): the rules of a multi-node job's members, for the services that write them.

A job with ``num_nodes`` N > 1 is dispatched (``dispatch.dispatch_gang``) only when N distinct available workers whose
agents run multi-node members (``Worker.multi_node``: ours, never SimpleTuner's released agent) can each give it
``gpu_count`` GPUs, all at once in one transaction: the workers are taken in one order (their ids) with SKIP LOCKED,
and a try that gets fewer than N takes none (its transaction holds them only until it ends, a moment later). A worker
that does not pack gives a member the whole worker: it holds the job as its ``current_job`` under its own
``gang_rank``. A packing worker (job_queue.packing) gives a member ``gpu_count`` of its free GPUs and one of its job
slots, beside the jobs it runs (the lowest free slots, read under the worker's lock as a packed job's are; a member
that needs 0 GPUs takes it only while it holds nothing): the member holds them (``GangMember.gpu_indices``,
``holds_gpus``) and they are sent in its ``job_submit``. The job's ``worker`` is rank 0's. Each attempt's members
are ``GangMember`` rows, all under the attempt's lease.

The job is ``running`` once every member acknowledged (``acknowledge``), ``completed`` once every member completed
(``member_completed``). A member that fails or is lost ends the attempt for all (``attempt_lost``): the job is
requeued as a whole by ``jobs_release`` (one retry), and every other member is told to stop (``job_cancel``); their
workers keep what the member holds (a whole worker busy, a packing worker's GPUs) until their agent says it runs the
job no more (``stale_member``; for a packing worker, its heartbeat, report or registration without the job), so no
GPU is given twice.
"""

import random

from django.conf import settings
from django.db.models import F, Q
from django.utils import timezone

from worker_agent import protocol
from workers import events as worker_events
from workers.models import Worker, WorkerStatus, WorkerType

from . import packing
from .models import JOB_ACTIVE, TARGET_WORKER_TYPES, GangMember, Job, labels_match
from .transitions import jobs_acknowledge

# A member's outcome (GangMember.outcome): what its worker said, or that the attempt ended without its word.
MEMBER_COMPLETED = "completed"
MEMBER_FAILED = "failed"
MEMBER_CANCELLED = "cancelled"
MEMBER_LOST = "lost"
MEMBER_STOPPED = "stopped"  # told to stop: another member failed or was lost


def is_gang(job):
    return job is not None and job.num_nodes > 1


def _gang_workers(job):
    """The workers that may be a member of ``job`` now, as the other rules of dispatch say (a stream open, not
    draining, of a type its target allows, whose agent runs multi-node members): one that does not pack idle, with no
    job and its GPUs; a packing one idle or busy with ``gpu_count`` GPUs free (idle, for a job that needs 0), holding
    no member of ``job`` still (an attempt before, not yet stopped); not an ephemeral one that has finished a job on
    its stream (it is leaving: like a freed ephemeral worker, it gets another job only by asking, and a queued gang
    is no job it may ask for). Their labels are matched by the caller, and a packing worker's room again under its
    lock (``take_workers``)."""
    whole = Q(max_jobs__lte=1, status=WorkerStatus.IDLE, current_job__isnull=True, gpu_count__gte=job.gpu_count)
    if job.gpu_count:
        packed = Q(max_jobs__gt=1, status__in=(WorkerStatus.IDLE, WorkerStatus.BUSY), gpus_free__gte=job.gpu_count)
    else:
        packed = Q(max_jobs__gt=1, status=WorkerStatus.IDLE)
    stale = GangMember.objects.filter(job=job, holds_gpus=True, worker__isnull=False).values("worker_id")
    return Worker.objects.filter(
        whole | packed,
        stream_id__isnull=False,
        drain_requested_at__isnull=True,
        multi_node=True,
        worker_type__in=TARGET_WORKER_TYPES[job.target],
    ).exclude(pk__in=stale).exclude(
        worker_type=WorkerType.EPHEMERAL, last_job_finished_at__isnull=False,
        stream_opened_at__isnull=False, last_job_finished_at__gte=F("stream_opened_at"),
    )


def matching_ids(job):
    """The ids of the workers ``_gang_workers`` offers ``job`` whose labels match, in the one order gangs take
    them (their ids): one read, no lock."""
    rows = _gang_workers(job).order_by("pk").values_list("pk", "labels")
    return [pk for pk, labels in rows if labels_match(job.worker_labels, labels)]


def take_workers(job):
    """Lock N (``job.num_nodes``) of the workers that may run ``job``'s members, in id order, skipping those another
    transaction holds and the packing ones whose room (read under their lock: ``packing.member_fits``) is gone; return
    ``(workers, held)``: them (rank 0 first) and ``{packing worker id: what it holds}``, or None when fewer than N are
    free now (none is kept)."""
    ids = matching_ids(job)
    if len(ids) < job.num_nodes:
        return None
    locked = list(_gang_workers(job).filter(pk__in=ids).select_for_update(skip_locked=True).order_by("pk"))
    held = packing.held_by([worker.pk for worker in locked if worker.packs])
    locked = [worker for worker in locked if not worker.packs or packing.member_fits(worker, job, held[worker.pk])]
    if len(locked) < job.num_nodes:
        return None
    return locked[: job.num_nodes], held


def master_address(worker):
    """Where the other members reach ``worker`` (rank 0): its agent's ``advertise_address``, else the address the
    orchestrator saw it register from."""
    return worker.advertise_address or worker.registered_address


def master_port(worker, *, avoid=None):
    """A port from ``GANG_PORT_RANGE`` for a gang whose rank 0 is ``worker``: none that another live gang with rank 0
    there holds, nor ``avoid`` (the port the job's previous attempt was given); None when every one is held."""
    low, high = settings.SIMPLETUNER["GANG_PORT_RANGE"]
    held = set(
        Job.objects.filter(worker_id=worker.pk, status__in=JOB_ACTIVE, num_nodes__gt=1).values_list("master_port", flat=True)
    )
    free = [port for port in range(low, high + 1) if port not in held and port != avoid]
    if not free and avoid is not None and avoid not in held and low <= avoid <= high:
        free = [avoid]
    return random.choice(free) if free else None


def members_create(*, job, workers, lease_id, gpu_indices):
    """Record the members of ``job``'s attempt ``lease_id``: ``workers``, rank 0 first; a member on a packing worker
    holds the GPUs ``gpu_indices`` gives it there (``{worker id: indices}``)."""
    return GangMember.objects.bulk_create(
        GangMember(
            job=job, lease_id=lease_id, rank=rank, worker=worker, worker_name=worker.name,
            gpu_indices=gpu_indices.get(worker.pk), holds_gpus=worker.pk in gpu_indices,
        )
        for rank, worker in enumerate(workers)
    )


def gang_fields(job, *, rank, master_addr, gpu_indices=None):
    """The ``job_submit`` fields (protocol.JobSubmitEvent) that make a member of rank ``rank`` of ``job``'s attempt;
    with ``gpu_indices`` (a member on a packing worker) the GPUs it runs on there, as a packed job's payload has
    them (none for a job that needs 0: it has the whole worker)."""
    fields = {"num_nodes": job.num_nodes, "node_rank": rank, "master_addr": master_addr, "master_port": job.master_port}
    if gpu_indices is not None and job.gpu_count:
        fields["gpu_indices"] = list(gpu_indices)
    return fields


def member_submit_fields(job, worker_id):
    """``gang_fields`` of worker ``worker_id``'s member of ``job``'s attempt, to send its ``job_submit`` again (its
    stream reopened before it acknowledged), or None when it is no such member."""
    member = GangMember.objects.filter(
        job=job, lease_id=job.lease_id, worker_id=worker_id, outcome="", acknowledged_at__isnull=True
    ).first()
    if member is None:
        return None
    rank0 = Worker.objects.filter(pk=job.worker_id).only("advertise_address", "registered_address").first()
    address = master_address(rank0) if rank0 is not None else ""
    return gang_fields(job, rank=member.rank, master_addr=address, gpu_indices=member.gpu_indices)


def live_member(job, worker):
    """``worker``'s member of ``job``'s current attempt, still running (no outcome), or None."""
    if not is_gang(job) or not job.lease_id or job.status not in JOB_ACTIVE:
        return None
    return GangMember.objects.filter(job=job, lease_id=job.lease_id, worker_id=worker.pk, outcome="").first()


def member_of(job, worker):
    """``worker``'s member of ``job``'s current attempt, whatever its outcome, or None."""
    if not job.lease_id:
        return None
    return GangMember.objects.filter(job=job, lease_id=job.lease_id, worker_id=worker.pk).first()


def stale_member(worker, job):
    """Whether locked ``worker`` holds multi-node ``job`` (its ``current_job``) though it is no live member of the job's
    current attempt: the attempt ended (another member failed or was lost, or it was cancelled) or another runs."""
    return is_gang(job) and live_member(job, worker) is None


def part_over(held):
    """Whether ``held`` (one of a packing worker's ``packing.held_jobs``) is a gang member whose part is over: it has
    an outcome (completed, told to stop, ...), or its job's current attempt is another one (or none). Such a member
    keeps its GPUs until its agent says it runs the job no more."""
    member = getattr(held, "member", None)
    if member is None:
        return False
    return bool(member.outcome) or member.lease_id != held.lease_id or held.status not in JOB_ACTIVE


def live_leases(jobs, worker_ids):
    """``{lease id: [worker ids]}``: the current attempts of multi-node ``jobs`` with a live member on ``worker_ids``
    (one read; none when no job is a gang)."""
    leases = [job.lease_id for job in jobs if is_gang(job) and job.lease_id]
    found = {}
    if leases:
        members = GangMember.objects.filter(lease_id__in=leases, worker_id__in=list(worker_ids), outcome="")
        for lease, worker_id in members.values_list("lease_id", "worker_id"):
            found.setdefault(lease, []).append(worker_id)
    return found


def acknowledge_by(*, worker, jobs, actor, reason, now=None, **fields):
    """``worker`` acknowledges its dispatch of each locked job of ``jobs``: a job of one worker at once
    (``jobs_acknowledge``); a multi-node job once every member has (``acknowledge``). Return the jobs now running."""
    now = now or timezone.now()
    ready = [job for job in jobs if not is_gang(job) or acknowledge(job=job, worker=worker, now=now)]
    return jobs_acknowledge(jobs=ready, actor=actor, reason=reason, now=now, **fields)


def acknowledge(*, job, worker, now):
    """Record that ``worker``'s member of ``job``'s attempt acknowledged it; return whether every member has (the
    caller then acknowledges the job: ``running``). A worker that is no live member acknowledges nothing."""
    updated = GangMember.objects.filter(
        job=job, lease_id=job.lease_id, worker_id=worker.pk, outcome="", acknowledged_at__isnull=True
    ).update(acknowledged_at=now)
    if not updated and live_member(job, worker) is None:
        return False
    return not GangMember.objects.filter(lease_id=job.lease_id, acknowledged_at__isnull=True).exists()


def member_completed(*, job, worker, now):
    """Record that ``worker``'s member of ``job``'s attempt completed; return whether every member has."""
    GangMember.objects.filter(job=job, lease_id=job.lease_id, worker_id=worker.pk, outcome="").update(
        outcome=MEMBER_COMPLETED, finished_at=now, acknowledged_at=now
    )
    return not GangMember.objects.filter(lease_id=job.lease_id).exclude(outcome=MEMBER_COMPLETED).exists()


def attempt_lost(*, jobs, outcome, lost_workers=(), now=None):
    """The current attempts of multi-node ``jobs`` end (a member failed, was lost, or the whole attempt was taken
    back): the members on ``lost_workers`` get ``outcome``, every other member still running is told to stop
    (``job_cancel`` to its worker, once committed) and ends ``stopped``. Call before the jobs are released (their
    lease is read here). Set-based: one read and two UPDATEs for them all."""
    now = now or timezone.now()
    leases = [job.lease_id for job in jobs if is_gang(job) and job.lease_id]
    if not leases:
        return
    lost = [str(pk) for pk in lost_workers]
    running = GangMember.objects.filter(lease_id__in=leases, outcome="")
    others = list(running.exclude(worker_id__in=lost).values_list("job_id", "lease_id", "worker_id"))
    running.filter(worker_id__in=lost).update(outcome=outcome, finished_at=now)
    running.update(outcome=MEMBER_STOPPED, finished_at=now)
    for job_id, lease, worker_id in others:
        if worker_id is not None:
            worker_events.publish_on_commit(worker_id, protocol.JOB_CANCEL, job_id=job_id, attempt=lease)


def cancel_members(job):
    """Tell every member of ``job``'s attempt still running to stop (an operator's cancel), once committed."""
    running = GangMember.objects.filter(lease_id=job.lease_id, outcome="")
    for worker_id in list(running.values_list("worker_id", flat=True)):
        if worker_id is not None:
            worker_events.publish_on_commit(worker_id, protocol.JOB_CANCEL, job_id=job.pk, attempt=job.lease_id)
    running.update(outcome=MEMBER_CANCELLED, finished_at=timezone.now())


def members_of_latest(job):
    """The members of ``job``'s latest gang attempt, rank 0 first: ``[{worker_id, worker_name, rank, gpu_indices,
    acknowledged, outcome}]`` ([] for a job that never ran as a gang)."""
    if not is_gang(job):
        return []
    lease = (
        GangMember.objects.filter(job=job).order_by("-id").values_list("lease_id", flat=True).first()
        if not job.lease_id
        else job.lease_id
    )
    return [
        {
            "worker_id": member.worker_id,
            "worker_name": member.worker_name,
            "rank": member.rank,
            "gpu_indices": member.gpu_indices,
            "acknowledged": member.acknowledged_at is not None,
            "outcome": member.outcome,
        }
        for member in GangMember.objects.filter(job=job, lease_id=lease).order_by("rank")
    ]


def _plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def waiting_reason(job):
    """Why queued multi-node ``job`` waits: how many workers it needs, with what, and how many have room now."""
    need = f"≥ {job.gpu_count} free GPU" if job.gpu_count else "the whole worker"
    selectors = ", ".join(f"{key}={value}" for key, value in (job.worker_labels or {}).items())
    what = f"needs {_plural(job.num_nodes, 'worker')} with {need}" + (f" matching {selectors}" if selectors else "")
    room = len(matching_ids(job))
    if room >= job.num_nodes:
        return f"{what}; {room} have room now: dispatch pending"
    capable = Worker.objects.filter(
        multi_node=True, worker_type__in=TARGET_WORKER_TYPES[job.target], gpu_count__gte=job.gpu_count
    ).values_list("labels", flat=True)
    able = sum(1 for labels in capable if labels_match(job.worker_labels, labels))
    if able < job.num_nodes:
        return f"{what}; only {able} such worker(s) whose agent runs multi-node jobs are registered"
    return f"{what}; {room} {'has' if room == 1 else 'have'} room now"
