"""The artifact store's periodic sweep: artifacts past their retention go, with their files."""

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from audit import actions
from audit.services import Actor, audit_events, audit_write, audited_atomic

from .models import Artifact, Checkpoint
from .storage import file_delete

SWEEP_BATCH = 500


def sweep_expired_artifacts(*, now=None, batch=SWEEP_BATCH):
    """Delete artifacts older than ``ARTIFACT_RETENTION_DAYS`` (0: keep them) and their files; return how many.

    Set-based and safe to run twice at once: each batch deletes only rows still there and still old,
    and a checkpoint that lost a file is deleted with it (a resume never gets a partial one).
    """
    days = settings.SIMPLETUNER["ARTIFACT_RETENTION_DAYS"]
    if not days:
        return 0
    cutoff = (now or timezone.now()) - timedelta(days=days)
    removed = 0
    while True:
        with audited_atomic():
            rows = list(
                Artifact.objects.select_for_update(skip_locked=True)
                .filter(updated_at__lt=cutoff)
                .order_by("pk")
                .values_list("pk", "job_id", "storage_name", "checkpoint_step")[:batch]
            )
            if not rows:
                return removed
            Artifact.objects.filter(pk__in=[pk for pk, *_ in rows]).delete()
            steps = {(job_id, step) for _, job_id, _, step in rows if step is not None}
            for job_id in {job_id for job_id, _ in steps}:
                Checkpoint.objects.filter(job_id=job_id, step__in=[s for j, s in steps if j == job_id]).delete()
            per_job = {}
            for _, job_id, _, _ in rows:
                per_job[job_id] = per_job.get(job_id, 0) + 1
            audit_write(
                audit_events(
                    actor=Actor.system("artifact retention"),
                    action=actions.ARTIFACTS_EXPIRED,
                    target_type="job",
                    rows=[(job_id, {"deleted": count, "retention_days": days}) for job_id, count in per_job.items()],
                )
            )
            names = [name for _, _, name, _ in rows]
            transaction.on_commit(lambda names=names: [file_delete(name) for name in names], robust=True)
        removed += len(rows)
        if len(rows) < batch:
            return removed
