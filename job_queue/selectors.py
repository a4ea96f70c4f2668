"""Reads about jobs that need more than a filter: why a queued job waits, whether work waits for a worker."""

from collections import Counter

from django.db.models import Max

from workers.models import Worker, WorkerStatus, WorkerType

from .models import TARGET_WORKER_TYPES, Job, JobStatus, JobTarget, job_fits_worker, labels_match, targets_for_worker_type


def _plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def job_waiting_reason(job):
    """Return a sentence saying why queued ``job`` has not been dispatched, or None if it is not queued."""
    if job.status != JobStatus.QUEUED:
        return None
    pool = Worker.objects.filter(worker_type__in=TARGET_WORKER_TYPES[job.target]).order_by()
    kind = "local worker" if job.target == "local" else "worker"
    best = pool.aggregate(most=Max("gpu_count"))["most"]
    if best is None:
        return f"no {kind} is registered"
    if best < job.gpu_count:
        return f"no {kind} has >= {job.gpu_count} GPUs (the most any has is {best})"
    # Tuples, not model instances: at 10,000 workers this is the difference between ~20 ms and ~250 ms.
    enough_gpus = pool.filter(gpu_count__gte=job.gpu_count).values_list(
        "labels", "status", "stream_id", "drain_requested_at"
    )
    matching = [(status, stream, drain) for labels, status, stream, drain in enough_gpus if labels_match(job.worker_labels, labels)]
    if not matching:
        wanted = ", ".join(f"{k}={v}" for k, v in job.worker_labels.items())
        return f"no {kind} with >= {job.gpu_count} GPUs matches labels {wanted}{_auto_fallback_note(job)}"
    available = sum(1 for status, stream, drain in matching if status == WorkerStatus.IDLE and stream is not None and drain is None)
    if available:
        ahead = (
            Job.objects.filter(status=JobStatus.QUEUED, priority__gte=job.priority, submitted_at__lt=job.submitted_at)
            .count()
        )
        if ahead:
            return f"{_plural(available, 'matching worker')} idle; {ahead} earlier job(s) go first"
        return f"{_plural(available, 'matching worker')} idle; dispatch pending"
    counts = Counter("idle without an open stream" if status == WorkerStatus.IDLE else status for status, _, _ in matching)
    parts = [f"{n} {state}" for state, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    verb = "matches" if len(matching) == 1 else "match"
    return f"{_plural(len(matching), kind)} {verb} but none is available ({', '.join(parts)}){_auto_fallback_note(job)}"


def _auto_fallback_note(job):
    """Return why an ``auto`` job with label selectors does not fall back to the local worker ("" if it may).

    ``auto`` prefers a remote worker and falls back to the local one, which must match the labels
    too: the selectors are the operator's requirements, not a preference.
    """
    if job.target != JobTarget.AUTO or not job.worker_labels:
        return ""
    local = list(Worker.objects.filter(worker_type=WorkerType.LOCAL).values_list("labels", flat=True))
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
    ).only("pk", "worker_labels", "gpu_count")
    return any(job_fits_worker(job, worker) for job in candidates.iterator(chunk_size=batch))
