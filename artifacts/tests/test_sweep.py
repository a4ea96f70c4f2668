"""The retention sweep: set-based, removes old artifacts with their files and the checkpoints they belonged to."""

from datetime import timedelta

import pytest
from django.core.files.base import ContentFile
from django.utils import timezone

from artifacts.models import Artifact, Checkpoint
from artifacts.sweeps import sweep_expired_artifacts
from artifacts.storage import artifact_storage
from audit import actions
from simpletuner_site.scheduler import sweep_schedule
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db


def make(job_id, key, *, age_days, step=None):
    name = artifact_storage().save(f"outputs/{job_id}/x/{key}", ContentFile(b"data"))
    artifact = Artifact.objects.create(
        job_id=job_id, key=key, storage_name=name, size=4, sha256="0" * 64, lease_id="a_1", attempt_number=1,
        checkpoint_step=step,
    )
    Artifact.objects.filter(pk=artifact.pk).update(updated_at=timezone.now() - timedelta(days=age_days))
    if step is not None:
        Checkpoint.objects.get_or_create(
            job_id=job_id, step=step, defaults={"lease_id": "a_1", "attempt_number": 1, "last_upload_at": timezone.now(), "completed_at": timezone.now()}
        )
    return name


def test_old_artifacts_go_with_their_files_and_checkpoints(settings, artifact_storage_dir, commit):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "ARTIFACT_RETENTION_DAYS": 30}
    old = make("j_a", "out/checkpoint-5/m.bin", age_days=31, step=5)
    make("j_a", "out/checkpoint-9/m.bin", age_days=1, step=9)
    make("j_b", "out/final.bin", age_days=40)

    with commit():
        assert sweep_expired_artifacts() == 2
    with commit():
        assert sweep_expired_artifacts() == 0  # run again: nothing left to do

    assert list(Artifact.objects.values_list("key", flat=True)) == ["out/checkpoint-9/m.bin"]
    assert list(Checkpoint.objects.values_list("step", flat=True)) == [9]
    assert not (artifact_storage_dir / old).exists()
    assert sorted(r.target_id for r in audit_rows(actions.ARTIFACTS_EXPIRED)) == ["j_a", "j_b"]


def test_retention_zero_keeps_everything(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "ARTIFACT_RETENTION_DAYS": 0}
    make("j_a", "out/final.bin", age_days=4000)
    assert sweep_expired_artifacts() == 0
    assert Artifact.objects.count() == 1


def test_the_sweep_runs_in_batches(settings, commit):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "ARTIFACT_RETENTION_DAYS": 1}
    for index in range(5):
        make("j_a", f"out/{index}.bin", age_days=2)
    with commit():
        assert sweep_expired_artifacts(batch=2) == 5
    assert not Artifact.objects.exists()


def test_the_sweep_is_scheduled_like_the_others():
    assert "artifacts.sweep_expired_artifacts" in {name for name, _fn, _interval in sweep_schedule()}
