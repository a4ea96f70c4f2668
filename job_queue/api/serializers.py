"""Request and response shapes of the queue API."""

from django.urls import reverse
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from artifacts.selectors import artifacts_for_job, attempt_steps
from common.fields import BoundedInt, BoundedJSON, BoundedText, Labels, StrictBoolean
from common.http import api_url
from common.inputs import GPU_COUNT_MAX
from common.serializers import ModelSerializer, Serializer
from training_configs.api.serializers import ConfigShown

from ..models import Job, JobAttempt, JobTarget
from ..selectors import job_waiting_reason


class JobSubmitSerializer(Serializer):
    config_name = BoundedText(max_length=255)
    config = BoundedJSON(types=(dict,), required=False, default=dict)
    dataloader = BoundedJSON(types=(dict, list), required=False, allow_null=True, default=None)
    target = serializers.ChoiceField(choices=JobTarget.choices, default=JobTarget.WORKER)
    worker_labels = Labels(required=False, default=dict, help_text="Label name -> glob; the rules: docs/api.md, Limits.")
    gpu_count = BoundedInt(required=False, allow_null=True, min_value=0, max_value=GPU_COUNT_MAX, default=None)
    priority = BoundedInt(required=False, default=0, min_value=-1000, max_value=1000)
    max_retries = BoundedInt(required=False, allow_null=True, min_value=0, max_value=100, default=None)
    retry_on_failure = StrictBoolean(required=False, default=False)


class JobAttemptSerializer(ModelSerializer):
    worker_id = serializers.CharField(allow_null=True)

    class Meta:
        model = JobAttempt
        fields = ["number", "lease_id", "worker_id", "worker_name", "dispatched_at", "started_at", "finished_at", "outcome", "error"]


class JobSerializer(ModelSerializer):
    worker_id = serializers.CharField(allow_null=True, read_only=True)
    retry_of = serializers.CharField(source="retry_of_id", allow_null=True, read_only=True)
    submitted_by = serializers.SerializerMethodField()
    waiting_reason = serializers.SerializerMethodField()
    url = serializers.SerializerMethodField(help_text="This job's own address in the API.")
    config_version = serializers.SerializerMethodField(help_text="The stored config version the job runs; null: config not stored.")
    config_stored = serializers.SerializerMethodField()
    config = ConfigShown(read_only=True, help_text="The trainer's config; secret keys' values masked without configs.view_config_secrets.")
    dataloader = ConfigShown(read_only=True, allow_null=True, help_text="The dataloader config, if any; masked alike.")

    class Meta:
        model = Job
        fields = [
            "id",
            "url",
            "config_name",
            "config_version",
            "config_stored",
            "config",
            "dataloader",
            "target",
            "worker_labels",
            "gpu_count",
            "priority",
            "status",
            "attempt_count",
            "retry_count",
            "max_retries",
            "retry_on_failure",
            "worker_id",
            "worker_name",
            "progress",
            "last_error",
            "exit_code",
            "log_tail",
            "waiting_reason",
            "submitted_at",
            "dispatched_at",
            "started_at",
            "finished_at",
            "submitted_by",
            "retry_of",
        ]
        read_only_fields = fields

    def get_submitted_by(self, job) -> str | None:
        return job.submitted_by.get_username() if job.submitted_by_id and job.submitted_by else None

    def get_url(self, job) -> str:
        return api_url(self.context.get("request"), "queue-job", job_id=job.pk)

    def get_config_version(self, job) -> int | None:
        return job.training_config.version if job.training_config_id else None

    def get_config_stored(self, job) -> bool:
        return job.training_config_id is not None

    def get_waiting_reason(self, job) -> str | None:
        if not self.context.get("with_reason"):
            return None
        return job_waiting_reason(job)


class ArtifactSerializer(Serializer):
    key = serializers.CharField()
    size = serializers.IntegerField()
    sha256 = serializers.CharField()
    attempt = serializers.IntegerField(source="attempt_number")
    checkpoint_step = serializers.IntegerField(allow_null=True)
    download_url = serializers.SerializerMethodField(help_text="Needs the artifacts.download_artifact permission.")

    def get_download_url(self, artifact) -> str:
        return reverse("artifact-download", kwargs={"artifact_id": artifact.pk})


class JobAttemptStepsSerializer(JobAttemptSerializer):
    """An attempt on the job's detail: with the step it resumed from and the furthest step it reported."""

    start_step = serializers.IntegerField(help_text="The checkpoint step it resumed from (0: from scratch).")
    reached_step = serializers.IntegerField(allow_null=True, help_text="The furthest step it reported or checkpointed.")

    class Meta(JobAttemptSerializer.Meta):
        fields = [*JobAttemptSerializer.Meta.fields, "start_step", "reached_step"]


class JobDetailSerializer(JobSerializer):
    attempts = serializers.SerializerMethodField()
    artifacts = serializers.SerializerMethodField()

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "attempts", "artifacts"]
        read_only_fields = fields

    @extend_schema_field(JobAttemptStepsSerializer(many=True))
    def get_attempts(self, job):
        """Each attempt, with the step it started from (a resumed checkpoint's) and the furthest it reported."""
        steps = attempt_steps(job.pk)
        rows = JobAttemptSerializer(job.attempts.all(), many=True).data
        for row in rows:
            start, reached = steps.get(row["lease_id"], (0, None))
            row["start_step"], row["reached_step"] = start, reached
        return rows

    @extend_schema_field(ArtifactSerializer(many=True))
    def get_artifacts(self, job):
        return ArtifactSerializer(artifacts_for_job(job.pk), many=True).data


class JobSubmittedSerializer(JobSerializer):
    """The submit response (documentation only): the job plus ``job_id`` and whether it went out at once."""

    job_id = serializers.CharField(read_only=True)
    dispatched = serializers.BooleanField(read_only=True)

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "job_id", "dispatched"]
        read_only_fields = fields
