"""Every write to artifacts and checkpoints but the retention sweep (``sweeps``): recording an upload, completing checkpoints."""

from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone

from audit import actions
from audit.services import audit_events, audit_record, audit_write
from common.errors import NotFound, TooLarge
from worker_agent import protocol

from .models import Artifact, AttemptSteps, Checkpoint
from .storage import file_delete

def _limits():
    config = settings.SIMPLETUNER
    return config["ARTIFACT_MAX_BYTES"], config["ARTIFACT_JOB_QUOTA_BYTES"]


def _quota_used(job_id, key):
    return Artifact.objects.filter(job_id=job_id).exclude(key=key).aggregate(total=Sum("size"))["total"] or 0


def upload_limit(*, job_id, key, declared=None):
    """Return how many bytes an upload of ``key`` to ``job_id`` may hold (a replaced file's size is freed).

    Raise TooLarge (413, ``upload_too_large`` or ``quota_exceeded``) when ``declared`` (the
    Content-Length, if sent) is already over it.
    """
    max_bytes, quota = _limits()
    room = quota - _quota_used(job_id, key)
    if declared is not None and declared > max_bytes:
        raise TooLarge(f"the file is {declared} bytes; an artifact may hold at most {max_bytes}", code=protocol.UPLOAD_TOO_LARGE)
    if declared is not None and declared > room:
        raise TooLarge(
            f"the file is {declared} bytes; the job has {max(room, 0)} bytes left of its {quota}-byte quota",
            code=protocol.QUOTA_EXCEEDED,
        )
    return max(min(max_bytes, room), 0)


def artifact_record(*, job_id, lease_id, attempt_number, key, stored, actor, declares=False, now=None):
    """Record ``stored`` (a StoredFile) as ``key`` of ``job_id``, uploaded by attempt ``lease_id``; return
    ``(artifact, created)``. Call inside the caller's ``audited_atomic()``, which has fenced the attempt.

    A file the key named before is removed from storage once this commits. A key under a
    ``checkpoint-<step>/`` segment adds it to that checkpoint, which is complete once the attempt
    speaks after it (``checkpoints_complete``), or, when ``declares`` (the uploader said it declares the
    checkpoint itself), only once declared (``checkpoint_declare_complete``). Raise TooLarge
    (``quota_exceeded``) if the job's quota was spent by concurrent uploads meanwhile.
    """
    now = now or timezone.now()
    _max_bytes, quota = _limits()
    if _quota_used(job_id, key) + stored.size > quota:
        raise TooLarge(f"the job's {quota}-byte artifact quota is spent", code=protocol.QUOTA_EXCEEDED)
    found = protocol.checkpoint_step(key)
    step = found[0] if found else None
    existing = Artifact.objects.select_for_update().filter(job_id=job_id, key=key).first()
    fields = {
        "storage_name": stored.name,
        "size": stored.size,
        "sha256": stored.sha256,
        "lease_id": lease_id,
        "attempt_number": attempt_number,
        "checkpoint_step": step,
    }
    if existing is None:
        artifact = Artifact.objects.create(job_id=job_id, key=key, **fields)
    else:
        replaced = existing.storage_name
        for name, value in fields.items():
            setattr(existing, name, value)
        existing.save()
        artifact = existing
        if replaced != stored.name:
            transaction.on_commit(lambda: file_delete(replaced), robust=True)
    if step is not None:
        Checkpoint.objects.update_or_create(
            job_id=job_id,
            step=step,
            defaults={
                "lease_id": lease_id,
                "attempt_number": attempt_number,
                "last_upload_at": now,
                "completed_at": None,
                "declared": declares,
            },
        )
    audit_record(
        actor=actor,
        action=actions.ARTIFACT_STORED,
        target_type="job",
        target_id=job_id,
        details={"key": key, "size": stored.size, "sha256": stored.sha256, "attempt": attempt_number, "replaced": existing is not None},
    )
    return artifact, existing is None


def checkpoints_complete(*, lease_id, actor, now=None):
    """Mark complete the checkpoints attempt ``lease_id`` uploaded before ``now`` (it spoke after them), but those
    it declares itself; return their steps. Set-based; call inside the transaction of the report or heartbeat
    that spoke."""
    now = now or timezone.now()
    pending = Checkpoint.objects.filter(
        lease_id=lease_id, completed_at__isnull=True, declared=False, last_upload_at__lt=now
    )
    rows = list(pending.values_list("pk", "job_id", "step"))
    if not rows:
        return []
    Checkpoint.objects.filter(pk__in=[pk for pk, _, _ in rows], completed_at__isnull=True).update(completed_at=now)
    audit_write(
        audit_events(
            actor=actor,
            action=actions.CHECKPOINT_COMPLETED,
            target_type="job",
            rows=[(job_id, {"step": step, "attempt": lease_id}) for _, job_id, step in rows],
        )
    )
    attempt_steps_record(lease_id=lease_id, job_id=rows[0][1], reached_step=max(step for _, _, step in rows))
    return [step for _, _, step in rows]


def checkpoint_declare_complete(*, job_id, lease_id, step, actor):
    """Mark attempt ``lease_id``'s checkpoint of ``step`` complete (its files are all uploaded); raise NotFound if
    the attempt uploaded no file of that checkpoint. Call inside the caller's ``audited_atomic()``."""
    done = Checkpoint.objects.filter(job_id=job_id, lease_id=lease_id, step=step).update(completed_at=timezone.now())
    if not done:
        raise NotFound(f"this attempt uploaded no file of checkpoint-{step}")
    attempt_steps_record(lease_id=lease_id, job_id=job_id, reached_step=step)  # a checkpoint proves the step
    audit_record(
        actor=actor,
        action=actions.CHECKPOINT_COMPLETED,
        target_type="job",
        target_id=job_id,
        details={"step": step, "attempt": lease_id, "declared": True},
    )


def attempt_steps_record(*, lease_id, job_id, start_step=None, reached_step=None):
    """Record the step attempt ``lease_id`` started from, or the latest it reached (never lower than before)."""
    if start_step is not None:
        AttemptSteps.objects.update_or_create(lease_id=lease_id, defaults={"job_id": job_id, "start_step": start_step})
    if reached_step is not None:
        updated = AttemptSteps.objects.filter(lease_id=lease_id).exclude(reached_step__gte=reached_step).update(
            reached_step=reached_step
        )
        if not updated and not AttemptSteps.objects.filter(lease_id=lease_id).exists():
            AttemptSteps.objects.get_or_create(lease_id=lease_id, defaults={"job_id": job_id, "reached_step": reached_step})
