"""Reads about jobs that need more than a filter: why a queued job is still waiting."""

from collections import Counter

from workers.models import Worker, WorkerStatus

from .models import JobStatus, labels_match


def _plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def job_waiting_reason(job):
    """Return a sentence saying why queued ``job`` has not been dispatched, or None if it is not queued."""
    from .services import TARGET_WORKER_TYPES

    if job.status != JobStatus.QUEUED:
        return None
    pool = list(
        Worker.objects.filter(worker_type__in=TARGET_WORKER_TYPES[job.target]).only(
            "status", "gpu_count", "labels", "stream_id", "drain_requested_at", "worker_type"
        )
    )
    kind = "local worker" if job.target == "local" else "worker"
    if not pool:
        return f"no {kind} is registered"
    enough_gpus = [w for w in pool if w.gpu_count >= job.gpu_count]
    if not enough_gpus:
        best = max(w.gpu_count for w in pool)
        return f"no {kind} has >= {job.gpu_count} GPUs (the most any has is {best})"
    matching = [w for w in enough_gpus if labels_match(job.worker_labels, w.labels)]
    if not matching:
        wanted = ", ".join(f"{k}={v}" for k, v in job.worker_labels.items())
        return f"no {kind} with >= {job.gpu_count} GPUs matches labels {wanted}"
    available = [
        w
        for w in matching
        if w.status == WorkerStatus.IDLE and w.stream_id is not None and w.drain_requested_at is None
    ]
    if available:
        ahead = (
            type(job)
            .objects.filter(status=JobStatus.QUEUED, priority__gte=job.priority, submitted_at__lt=job.submitted_at)
            .count()
        )
        if ahead:
            return f"{_plural(len(available), 'matching worker')} idle; {ahead} earlier job(s) go first"
        return f"{_plural(len(available), 'matching worker')} idle; dispatch pending"
    counts = Counter(
        "idle without an open stream" if w.status == WorkerStatus.IDLE else w.status for w in matching
    )
    parts = [f"{n} {state}" for state, n in sorted(counts.items(), key=lambda kv: -kv[1])]
    verb = "matches" if len(matching) == 1 else "match"
    return f"{_plural(len(matching), kind)} {verb} but none is available ({', '.join(parts)})"
