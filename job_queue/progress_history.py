"""Each attempt's progress over time (step and loss), kept as a bounded series for the job page's chart."""

import math

from django.utils import timezone

from .models import JobAttempt

MAX_SAMPLES = 400  # past it every other sample goes: the whole run stays, at half the resolution


def attempt_record_progress(*, lease_id, progress, now=None):
    """Add ``progress``'s step and loss (if it has either) to attempt ``lease_id``'s series."""
    if not lease_id or not isinstance(progress, dict):
        return
    step, loss = _number(progress.get("step")), _number(progress.get("loss"))
    if step is None and loss is None:
        return
    attempt = JobAttempt.objects.filter(lease_id=lease_id).only("pk", "dispatched_at", "progress_samples").first()
    if attempt is None:
        return
    samples = list(attempt.progress_samples or [])
    if samples and samples[-1][1:] == [step, loss]:
        return  # a heartbeat repeating the last report
    seconds = round(((now or timezone.now()) - attempt.dispatched_at).total_seconds(), 1)
    samples.append([seconds, step, loss])
    if len(samples) > MAX_SAMPLES:
        samples = samples[:-1:2] + samples[-1:]
    JobAttempt.objects.filter(pk=attempt.pk).update(progress_samples=samples)


def _number(value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return value
