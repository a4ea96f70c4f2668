"""Reads of artifacts: a job's files, the checkpoint a new attempt resumes from, the steps of each attempt."""

from worker_agent import protocol

from .models import Artifact, AttemptSteps, Checkpoint


def artifacts_for_job(job_id):
    """Return ``job_id``'s artifacts, by key."""
    return Artifact.objects.filter(job_id=job_id).order_by("key")


def resume_checkpoint(job_id):
    """Return ``job_id``'s latest complete checkpoint as a ``protocol.ResumeCheckpoint`` (without download
    URLs: ``files`` hold ``key``, ``size``, ``sha256``), or None."""
    checkpoint = (
        Checkpoint.objects.filter(job_id=job_id, completed_at__isnull=False).order_by("-step").first()
    )
    if checkpoint is None:
        return None
    files = list(
        Artifact.objects.filter(job_id=job_id, checkpoint_step=checkpoint.step).order_by("key").values("key", "size", "sha256")
    )
    if not files:
        return None
    return {
        "step": checkpoint.step,
        "checkpoint": f"{protocol.CHECKPOINT_PREFIX}{checkpoint.step}",
        "attempt": checkpoint.attempt_number,
        "files": files,
    }


def attempt_steps(job_id):
    """Return ``{lease_id: (start_step, reached_step)}`` for ``job_id``'s attempts."""
    return {row.lease_id: (row.start_step, row.reached_step) for row in AttemptSteps.objects.filter(job_id=job_id)}
