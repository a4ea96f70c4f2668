"""Files a job's attempts uploaded (weights, checkpoints, logs) and the checkpoints they form.

Rows name their job and attempt by id, not by foreign key: this app sits below ``job_queue`` (which
fences the uploads and reads the checkpoints back) and never imports it.
"""

from django.db import models


class Artifact(models.Model):
    """One file in a job's namespace: the latest upload of its key wins."""

    job_id = models.CharField(max_length=32, db_index=True)
    key = models.CharField(max_length=1024, help_text="Bucket and key as the trainer sent them, in the job's namespace.")
    storage_name = models.CharField(max_length=1200, help_text="Where the file is in the artifact storage.")
    size = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)
    lease_id = models.CharField(max_length=40, help_text="The attempt that uploaded it.")
    attempt_number = models.PositiveIntegerField()
    checkpoint_step = models.BigIntegerField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["job_id", "key"]
        constraints = [models.UniqueConstraint(fields=["job_id", "key"], name="artifact_key_unique")]
        permissions = [("download_artifact", "Can download an artifact")]

    def __str__(self):
        return f"{self.job_id}/{self.key}"


class Checkpoint(models.Model):
    """The files of one attempt under a ``checkpoint-<step>/`` segment; complete once the attempt spoke after them,
    or, for one uploaded as declared (``protocol.CHECKPOINT_DECLARES_HEADER``), once the attempt declares it."""

    job_id = models.CharField(max_length=32)
    step = models.BigIntegerField()
    lease_id = models.CharField(max_length=40)
    attempt_number = models.PositiveIntegerField()
    last_upload_at = models.DateTimeField()
    completed_at = models.DateTimeField(null=True, blank=True)
    declared = models.BooleanField(
        default=False, help_text="Complete only when its attempt declares it: its files were uploaded as a declared checkpoint."
    )

    class Meta:
        ordering = ["job_id", "step"]
        constraints = [models.UniqueConstraint(fields=["job_id", "step"], name="checkpoint_step_unique")]
        indexes = [models.Index(fields=["lease_id", "completed_at"], name="checkpoint_pending")]

    def __str__(self):
        return f"checkpoint-{self.step} of {self.job_id}"


class AttemptSteps(models.Model):
    """Per attempt: the step it resumed from and the last step it reported (shown on the job's page)."""

    lease_id = models.CharField(max_length=40, primary_key=True)
    job_id = models.CharField(max_length=32, db_index=True)
    start_step = models.BigIntegerField(default=0)
    reached_step = models.BigIntegerField(null=True, blank=True)
