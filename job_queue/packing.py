"""Several jobs on one worker (packing): the rules of a worker's GPU slots, with no write of their own.

A worker whose agent registered with ``max_jobs`` > 1 (``protocol.RegisterRequest``) runs up to that many jobs
at once, each on its own GPUs out of the worker's ``gpu_slots``. A job needs its ``gpu_count`` GPUs (the config's
``num_processes`` when submitted without one); a job whose need is 0 ("any") takes the whole worker, alone.

What a packing worker holds (``held_jobs``, ``held_by``: the one home of that rule) is its packed jobs and its
gang members. A packed job holds ``Job.gpu_indices`` while ``Job.holds_gpus``, set in its dispatch's transaction
(``dispatch._assign``) and cleared in the transaction it leaves the worker in (its end, its requeue, its cancel
confirmed; the indices stay as the record of where it ran until a requeue). A member of a multi-node job placed on
the worker (job_queue.gangs; rank 0 included: a gang job never sets ``Job.holds_gpus``, so nothing is counted twice)
holds its ``GangMember.gpu_indices`` while ``GangMember.holds_gpus``: from the gang's dispatch until its agent says
it runs the job no more, whatever the attempt's fate meanwhile. Each counts as one of the worker's ``max_jobs``. The
worker's ``gpus_free`` (what a new job or member may take) is recomputed from what it holds in those same
transactions. A worker that does not pack (``max_jobs`` 1: SimpleTuner's released agent) holds its one job as
``current_job``, as it always did, and nothing here applies to it.
"""

import copy

from django.db.models import Q

from .models import GangMember, Job, labels_match

HELD_FIELDS = (
    "pk", "status", "lease_id", "attempt_count", "retry_count", "max_retries", "gpu_count", "gpu_indices", "holds_gpus", "worker_id", "dispatched_at",
    "num_nodes", "config_name",
)


def packing_fields(data, gpu_count):
    """Return the Worker fields a registration ``data`` (validated) sets: ``max_jobs``, ``gpu_slots``,
    ``gpu_slots_declared``, and for a packing worker ``gpu_count``: its slots (all ``gpu_count`` GPUs when
    the agent named none), the GPUs its jobs are given."""
    max_jobs = data.get("max_jobs") or 1
    slots = data.get("gpu_slots")
    slots = sorted(slots) if slots is not None else list(range(gpu_count)) if max_jobs > 1 else []
    fields = {"max_jobs": max_jobs, "gpu_slots": slots, "gpu_slots_declared": bool(data.get("gpu_slots_declared"))}
    if max_jobs > 1:
        fields["gpu_count"] = len(slots)
    return fields


def holding_members(worker_ids):
    """The gang members that hold GPUs on packing workers ``worker_ids`` (``GangMember.holds_gpus``)."""
    return GangMember.objects.filter(worker_id__in=list(worker_ids), holds_gpus=True)


def _held_query(worker_ids):
    """The jobs that hold GPUs on packing workers ``worker_ids``: packed there, or with a member holding some there."""
    members = holding_members(worker_ids).values("job_id")
    return Job.objects.filter(Q(worker_id__in=list(worker_ids), holds_gpus=True) | Q(pk__in=members))


def _placed(jobs, worker_ids):
    """``{worker id: [what it holds]}`` out of ``jobs`` (``_held_query``): a packed job as it is (``member`` None); for
    each member holding GPUs on one of ``worker_ids``, a copy of its job whose ``gpu_indices`` are the member's there,
    ``holds_gpus`` True and ``member`` that GangMember row (one read of the members, none without a gang job)."""
    held = {worker_id: [] for worker_id in worker_ids}
    gang_ids = []
    for job in jobs:
        if job.holds_gpus and job.worker_id in held:
            job.member = None
            held[job.worker_id].append(job)
        else:
            gang_ids.append(job.pk)
    if gang_ids:
        by_id = {job.pk: job for job in jobs}
        for member in holding_members(worker_ids).filter(job_id__in=gang_ids).order_by("pk"):
            job = copy.copy(by_id[member.job_id])
            job.gpu_indices, job.holds_gpus, job.member = member.gpu_indices, True, member
            held[member.worker_id].append(job)
    return held


def held_jobs(worker_id, *, lock=False):
    """What packing worker ``worker_id`` holds (see the module's docstring; ``_placed``): its jobs still holding their
    GPUs (running, dispatched, or cancelled and not yet confirmed stopped) and its gang members holding theirs, oldest
    dispatch first; the jobs locked (waiting) with ``lock``."""
    jobs = _held_query([worker_id])
    if lock:
        jobs = jobs.select_for_update()
    jobs = list(jobs.order_by("dispatched_at", "pk").only(*HELD_FIELDS))
    return _placed(jobs, [worker_id])[worker_id]


def held_by(worker_ids):
    """``{worker id: [what it holds]}`` (as ``held_jobs``) for packing workers ``worker_ids`` (one read for them all,
    and one of their gang members when any job is a gang's)."""
    worker_ids = list(worker_ids)
    return _placed(list(_held_query(worker_ids).order_by("dispatched_at", "pk").only(*HELD_FIELDS)), worker_ids)


def holds(worker, job):
    """Whether packing ``worker`` holds ``job`` on its GPUs: packed there, or a member of it holding some there."""
    if job.worker_id == worker.pk and job.holds_gpus:
        return True
    return job.num_nodes > 1 and holding_members([worker.pk]).filter(job=job).exists()


def used_slots(held):
    return {index for job in held for index in (job.gpu_indices or ())}


def room(worker, held):
    """The ``gpus_free`` of packing ``worker`` holding the jobs ``held``: its slots none of them holds, 0 once it
    holds ``max_jobs`` jobs (a job that takes the whole worker holds every slot)."""
    if len(held) >= worker.max_jobs:
        return 0
    used = used_slots(held)
    return sum(1 for slot in worker.gpu_slots or () if slot not in used)


def allocate(worker, job, held):
    """Return the slots of packing ``worker`` that ``job`` gets beside the jobs ``held``: the lowest free ones, as
    many as it needs; every slot for a job that needs 0 (the caller places it only on a worker holding none)."""
    if not job.gpu_count:
        return list(worker.gpu_slots or ())
    used = used_slots(held)
    free = [slot for slot in worker.gpu_slots or () if slot not in used]
    if len(free) < job.gpu_count:
        raise ValueError(f"worker {worker.pk} has {len(free)} free GPUs; job {job.pk} needs {job.gpu_count}")
    return free[: job.gpu_count]


def member_fits(worker, job, held):
    """Whether packing ``worker`` holding ``held`` can take a member of multi-node ``job`` beside them: a free job
    slot and ``gpu_count`` free GPUs; for a job that needs 0 (the whole worker), only while it holds nothing."""
    if not job.gpu_count:
        return not held
    return room(worker, held) >= job.gpu_count


def job_fits_packed(job, worker):
    """Whether busy packing ``worker`` can take ``job`` beside its jobs now: the job needs at least one GPU (a job
    that needs 0 waits for the whole worker) and no more than the worker's ``gpus_free``, and its labels match (a
    multi-node job is placed as a gang: job_queue.gangs)."""
    return job.num_nodes <= 1 and 1 <= job.gpu_count <= worker.gpus_free and labels_match(job.worker_labels, worker.labels)
