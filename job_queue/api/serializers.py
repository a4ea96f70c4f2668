"""Request and response shapes of the queue API."""

from rest_framework import serializers

from ..models import Job, JobAttempt, JobTarget
from ..selectors import job_waiting_reason


class JobSubmitSerializer(serializers.Serializer):
    config_name = serializers.CharField(max_length=255)
    config = serializers.DictField(required=False, default=dict)
    dataloader = serializers.JSONField(required=False, allow_null=True, default=None)
    target = serializers.ChoiceField(choices=JobTarget.choices, default=JobTarget.WORKER)
    worker_labels = serializers.DictField(
        child=serializers.CharField(max_length=200), required=False, default=dict
    )
    gpu_count = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=1024, default=None)
    priority = serializers.IntegerField(required=False, default=0, min_value=-1000, max_value=1000)
    max_retries = serializers.IntegerField(required=False, allow_null=True, min_value=0, max_value=100, default=None)
    retry_on_failure = serializers.BooleanField(required=False, default=False)

    def validate_dataloader(self, value):
        if value is not None and not isinstance(value, (dict, list)):
            raise serializers.ValidationError("dataloader must be an object or a list")
        return value


class JobAttemptSerializer(serializers.ModelSerializer):
    worker_id = serializers.CharField(allow_null=True)

    class Meta:
        model = JobAttempt
        fields = ["number", "lease_id", "worker_id", "worker_name", "dispatched_at", "started_at", "finished_at", "outcome", "error"]


class JobSerializer(serializers.ModelSerializer):
    worker_id = serializers.CharField(allow_null=True, read_only=True)
    retry_of = serializers.CharField(source="retry_of_id", allow_null=True, read_only=True)
    submitted_by = serializers.SerializerMethodField()
    waiting_reason = serializers.SerializerMethodField()

    class Meta:
        model = Job
        fields = [
            "id",
            "config_name",
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

    def get_waiting_reason(self, job) -> str | None:
        if not self.context.get("with_reason"):
            return None
        return job_waiting_reason(job)


class JobDetailSerializer(JobSerializer):
    attempts = JobAttemptSerializer(many=True, read_only=True)

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "attempts"]
        read_only_fields = fields


class JobSubmittedSerializer(JobSerializer):
    """The submit response (documentation only): the job plus ``job_id`` and whether it went out at once."""

    job_id = serializers.CharField(read_only=True)
    dispatched = serializers.BooleanField(read_only=True)

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "job_id", "dispatched"]
        read_only_fields = fields
