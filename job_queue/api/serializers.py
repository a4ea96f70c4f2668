"""Request and response shapes of the queue API."""

from rest_framework import serializers

from common.fields import BoundedInt, BoundedJSON, BoundedText, Labels, StrictBoolean
from common.inputs import GPU_COUNT_MAX

from ..models import Job, JobAttempt, JobTarget
from ..selectors import job_waiting_reason


class JobSubmitSerializer(serializers.Serializer):
    config_name = BoundedText(max_length=255)
    config = BoundedJSON(types=(dict,), required=False, default=dict)
    dataloader = BoundedJSON(types=(dict, list), required=False, allow_null=True, default=None)
    target = serializers.ChoiceField(choices=JobTarget.choices, default=JobTarget.WORKER)
    worker_labels = Labels(required=False, default=dict, help_text="Label name -> glob; the rules: README, Limits.")
    gpu_count = BoundedInt(required=False, allow_null=True, min_value=0, max_value=GPU_COUNT_MAX, default=None)
    priority = BoundedInt(required=False, default=0, min_value=-1000, max_value=1000)
    max_retries = BoundedInt(required=False, allow_null=True, min_value=0, max_value=100, default=None)
    retry_on_failure = StrictBoolean(required=False, default=False)


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
