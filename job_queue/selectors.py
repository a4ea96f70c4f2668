"""Reads about jobs that need more than a filter: why a queued job waits, whether work waits for a worker."""

from collections import Counter

from django.db.models import BooleanField, Count, ExpressionWrapper, Q

from workers.models import Worker, WorkerStatus, WorkerType

from . import gangs
from .fairshare import queue_positions
from .limits import limits_hold_reasons
from .models import TARGET_WORKER_TYPES, Job, JobStatus, JobTarget, job_fits_worker, labels_match, targets_for_worker_type


def _plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def job_waiting_reason(job):
    """Return a sentence saying why queued ``job`` has not been dispatched, or None if it is not queued."""
    return jobs_waiting_reasons([job]).get(job.pk)


def jobs_waiting_reasons(jobs):
    """Return ``{job pk: sentence}`` saying why each queued one of ``jobs`` has not been dispatched.

    The fleet is read once for them all, counted in SQL by what a reason depends on (type, GPUs,
    status, stream, drain, and the labels only when some job selects on them): a row per distinct
    combination, a few for a fleet of like machines (one per label set when labels count), not one per
    worker, and one query whatever the number of jobs; and the running and GPU limits that hold a job back
    (``job_queue.limits``), read once for them all.
    """
    queued = [job for job in jobs if job.status == JobStatus.QUEUED]
    if not queued:
        return {}
    types = {kind for job in queued for kind in TARGET_WORKER_TYPES[job.target]}  # auto's include the local worker
    grouped = ["worker_type", "gpu_count", "status"]
    if any(job.worker_labels for job in queued):
        grouped.append("labels")
    # The busy packing workers' free GPUs (Worker.gpus_free) count too: the most free on one that matches.
    fleet = [
        (row["worker_type"], row["gpu_count"], row.get("labels"), row["status"], row["streaming"], row["draining"], row["n"],
         row["gpus_free"])
        for row in Worker.objects.filter(worker_type__in=types)
        .order_by()
        .values(
            *grouped,
            "gpus_free",
            streaming=ExpressionWrapper(Q(stream_id__isnull=False), output_field=BooleanField()),
            draining=ExpressionWrapper(Q(drain_requested_at__isnull=False), output_field=BooleanField()),
        )
        .annotate(n=Count("pk"))
    ]
    held = limits_hold_reasons(queued, gpus=lambda job: job.gpu_count or _fewest_gpus(job, fleet))
    return {
        job.pk: held.get(job.pk) or gangs.waiting_reason(job) if job.num_nodes > 1 else _waiting_reason(job, fleet, held.get(job.pk))
        for job in queued
    }


def _fewest_gpus(job, fleet):
    """The fewest GPUs among the workers that may run ``job`` (what a job needing none would hold at least), or 0."""
    kinds = TARGET_WORKER_TYPES[job.target]
    return min((gpus for kind, gpus, labels, *_ in fleet if kind in kinds and labels_match(job.worker_labels, labels)), default=0)


def _waiting_reason(job, fleet, held=None):
    """Return why queued ``job`` waits, given the ``fleet`` counts that ``jobs_waiting_reasons`` reads and why a limit
    holds it back (``held``), if one does."""
    kinds = TARGET_WORKER_TYPES[job.target]
    pool = [row for row in fleet if row[0] in kinds]
    kind = "local worker" if job.target == "local" else "worker"
    if not pool:
        return f"no {kind} is registered"
    best = max(gpus for _, gpus, *_ in pool)
    if best < job.gpu_count:
        return f"no {kind} has >= {job.gpu_count} GPUs (the most any has is {best})"
    matching = [
        (status, streaming, draining, n, free)
        for _, gpus, labels, status, streaming, draining, n, free in pool
        if gpus >= job.gpu_count and labels_match(job.worker_labels, labels)
    ]
    if not matching:
        wanted = ", ".join(f"{k}={v}" for k, v in job.worker_labels.items())
        return f"no {kind} with >= {job.gpu_count} GPUs matches labels {wanted}{_auto_fallback_note(job, fleet)}"
    if held:
        return held
    available = sum(n for status, streaming, draining, n, _ in matching if status == WorkerStatus.IDLE and streaming and not draining)
    if available:
        ahead = queue_positions([job.pk]).get(job.pk, 1) - 1  # in the order the dispatcher offers them
        if ahead:
            return f"{_plural(available, 'matching worker')} idle; {ahead} earlier job(s) go first"
        return f"{_plural(available, 'matching worker')} idle; dispatch pending"
    packed = [free for status, streaming, draining, _, free in matching if status == WorkerStatus.BUSY and streaming and free]
    if packed and job.gpu_count:  # busy packing workers with some GPUs free, too few for it
        most = max(packed)
        if most >= job.gpu_count:
            return f"a matching worker has {_plural(most, 'free GPU')}; dispatch pending"
        return f"needs {_plural(job.gpu_count, 'free GPU')}; the most free on a matching worker is {most}"
    counts = Counter()
    for status, streaming, draining, n, _ in matching:
        counts["idle without an open stream" if status == WorkerStatus.IDLE else status] += n
    total = sum(counts.values())
    parts = [f"{n} {state}" for state, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    verb = "matches" if total == 1 else "match"
    return f"{_plural(total, kind)} {verb} but none is available ({', '.join(parts)}){_auto_fallback_note(job, fleet)}"


def _auto_fallback_note(job, fleet):
    """Return why an ``auto`` job with label selectors does not fall back to the local worker ("" if it may).

    ``auto`` prefers a remote worker and falls back to the local one, which must match the labels
    too: the selectors are the operator's requirements, not a preference.
    """
    if job.target != JobTarget.AUTO or not job.worker_labels:
        return ""
    local = [labels for kind, _, labels, *_ in fleet if kind == WorkerType.LOCAL]
    if not local:
        return "; auto's fallback, the local worker, is not registered"
    if not any(labels_match(job.worker_labels, labels) for labels in local):
        return (
            "; auto falls back to the local worker only when it matches the labels too, and it does not "
            "(give it those labels, or submit without worker_labels)"
        )
    return ""


def jobs_waiting_for(worker, *, batch=200):
    """Return whether a queued job fits ``worker`` (its type, GPUs and labels; not its availability)."""
    if worker.drain_requested_at is not None:
        return False
    candidates = Job.objects.filter(
        status=JobStatus.QUEUED, target__in=targets_for_worker_type(worker.worker_type), gpu_count__lte=worker.gpu_count
    ).only("pk", "worker_labels", "gpu_count", "num_nodes")
    return any(job_fits_worker(job, worker) for job in candidates.iterator(chunk_size=batch))
