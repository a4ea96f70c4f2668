"""Several jobs on one worker (packing): the rules of a worker's GPU slots, with no write of their own.

A worker whose agent registered with ``max_jobs`` > 1 (``protocol.RegisterRequest``) runs up to that many jobs
at once, each on its own GPUs out of the worker's ``gpu_slots``. A job needs its ``gpu_count`` GPUs (the config's
``num_processes`` when submitted without one); a job whose need is 0 ("any") takes the whole worker, alone.
The GPUs a job holds are ``Job.gpu_indices`` while ``Job.holds_gpus``, set in its dispatch's transaction
(``dispatch._assign``) and cleared in the transaction it leaves the worker in (its end, its requeue, its cancel
confirmed; the indices stay as the record of where it ran until a requeue); the worker's
``gpus_free`` (what a new job may take) is recomputed from the jobs it holds in those same transactions. A worker
that does not pack (``max_jobs`` 1: SimpleTuner's released agent) holds its one job as ``current_job``, as it
always did, and nothing here applies to it.
"""

from .models import Job, labels_match

HELD_FIELDS = (
    "pk", "status", "lease_id", "attempt_count", "retry_count", "max_retries", "gpu_count", "gpu_indices", "holds_gpus", "worker_id", "dispatched_at"
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


def held_jobs(worker_id, *, lock=False):
    """The jobs placed on packing worker ``worker_id`` that still hold their GPUs (running, dispatched, or cancelled
    and not yet confirmed stopped), oldest dispatch first; locked (waiting) with ``lock``."""
    jobs = Job.objects.filter(worker_id=worker_id, holds_gpus=True)
    if lock:
        jobs = jobs.select_for_update()
    return list(jobs.order_by("dispatched_at", "pk").only(*HELD_FIELDS))


def held_by(worker_ids):
    """``{worker id: [its jobs that hold GPUs]}`` for packing workers ``worker_ids`` (one read for them all)."""
    held = {worker_id: [] for worker_id in worker_ids}
    for job in Job.objects.filter(worker_id__in=list(worker_ids), holds_gpus=True).order_by().only(*HELD_FIELDS):
        held[job.worker_id].append(job)
    return held


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


def job_fits_packed(job, worker):
    """Whether busy packing ``worker`` can take ``job`` beside its jobs now: the job needs at least one GPU (a job
    that needs 0 waits for the whole worker) and no more than the worker's ``gpus_free``, and its labels match (a
    multi-node job is placed as a gang: job_queue.gangs)."""
    return job.num_nodes <= 1 and 1 <= job.gpu_count <= worker.gpus_free and labels_match(job.worker_labels, worker.labels)
