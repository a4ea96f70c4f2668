"""Request and response shapes of the queue API."""

from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from artifacts.selectors import artifacts_for_job, attempt_steps
from common.fields import BoundedInt, BoundedJSON, BoundedText, Labels, StrictBoolean
from common.http import api_url
from common.inputs import GPU_COUNT_MAX
from common.serializers import ModelSerializer, Serializer
from training_configs.api.serializers import ConfigShown

from .. import gangs
from ..fairshare import queue_positions
from ..models import Job, JobAttempt, JobStatus, JobTarget
from ..selectors import job_waiting_reason, jobs_waiting_reasons


class JobSubmitSerializer(Serializer):
    config_name = BoundedText(max_length=255)
    config = BoundedJSON(types=(dict,), required=False, default=dict)
    dataloader = BoundedJSON(types=(dict, list), required=False, allow_null=True, default=None)
    target = serializers.ChoiceField(choices=JobTarget.choices, default=JobTarget.WORKER)
    worker_labels = Labels(required=False, default=dict, help_text="Label name -> glob; the rules: docs/api.md, Limits.")
    gpu_count = BoundedInt(required=False, allow_null=True, min_value=0, max_value=GPU_COUNT_MAX, default=None)
    num_nodes = BoundedInt(
        required=False, default=1, min_value=1, max_value=GPU_COUNT_MAX,
        help_text="Workers the job runs on at once, each giving it gpu_count GPUs (a gang; at most the fleet's size).",
    )
    priority = BoundedInt(required=False, default=0, min_value=-1000, max_value=1000)
    max_retries = BoundedInt(required=False, allow_null=True, min_value=0, max_value=100, default=None)
    retry_on_failure = StrictBoolean(required=False, default=False)
    team = BoundedText(
        max_length=64, required=False, allow_null=True, default=None,
        help_text="The team the job is charged to; default: yours, if you are in exactly one (docs/teams.md).",
    )


class JobAttemptSerializer(ModelSerializer):
    worker_id = serializers.CharField(allow_null=True)

    class Meta:
        model = JobAttempt
        fields = [
            "number", "lease_id", "worker_id", "worker_name", "gpu_indices", "dispatched_at", "started_at", "finished_at",
            "outcome", "error",
        ]


class _JobListSerializer(serializers.ListSerializer):
    """A list of jobs: the queued ones' places, and why they wait, read once for the whole page."""

    def to_representation(self, data):
        jobs = list(data.all() if hasattr(data, "all") else data)
        self.child.queue_positions = queue_positions([job.pk for job in jobs if job.status == JobStatus.QUEUED])
        if self.child.context.get("with_reason"):
            self.child.waiting_reasons = jobs_waiting_reasons(jobs)
        return super().to_representation(jobs)


class JobSerializer(ModelSerializer):
    worker_id = serializers.CharField(allow_null=True, read_only=True)
    retry_of = serializers.CharField(source="retry_of_id", allow_null=True, read_only=True)
    submitted_by = serializers.SerializerMethodField()
    team = serializers.SerializerMethodField(help_text="The team the job is charged to; null: none.")
    waiting_reason = serializers.SerializerMethodField()
    queue_position = serializers.SerializerMethodField(
        help_text="1-based place among the queued jobs in the order the dispatcher offers them now (priority, fair "
        "share, age; jobs held back by a limit included); null once not queued."
    )
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
            "num_nodes",
            "priority",
            "status",
            "attempt_count",
            "retry_count",
            "max_retries",
            "retry_on_failure",
            "worker_id",
            "worker_name",
            "gpu_indices",
            "progress",
            "last_error",
            "exit_code",
            "log_tail",
            "waiting_reason",
            "queue_position",
            "submitted_at",
            "dispatched_at",
            "started_at",
            "finished_at",
            "submitted_by",
            "team",
            "retry_of",
        ]
        read_only_fields = fields
        list_serializer_class = _JobListSerializer

    def get_queue_position(self, job) -> int | None:
        if job.status != JobStatus.QUEUED:
            return None
        known = getattr(self, "queue_positions", None)
        return (known if known is not None else queue_positions([job.pk])).get(job.pk)

    def get_submitted_by(self, job) -> str | None:
        return job.submitted_by.get_username() if job.submitted_by_id and job.submitted_by else None

    def get_team(self, job) -> str | None:
        return job.team.name if job.team_id and job.team else None

    def get_url(self, job) -> str:
        return api_url(self.context.get("request"), "queue-job", job_id=job.pk)

    def get_config_version(self, job) -> int | None:
        return job.training_config.version if job.training_config_id else None

    def get_config_stored(self, job) -> bool:
        return job.training_config_id is not None

    def get_waiting_reason(self, job) -> str | None:
        if not self.context.get("with_reason"):
            return None
        known = getattr(self, "waiting_reasons", None)
        return known.get(job.pk) if known is not None else job_waiting_reason(job)


class ArtifactSerializer(Serializer):
    key = serializers.CharField()
    size = serializers.IntegerField()
    sha256 = serializers.CharField()
    attempt = serializers.IntegerField(source="attempt_number")
    checkpoint_step = serializers.IntegerField(allow_null=True)
    download_url = serializers.SerializerMethodField(help_text="Needs the artifacts.download_artifact permission.")

    def get_download_url(self, artifact) -> str:
        return api_url(self.context.get("request"), "artifact-download", artifact_id=artifact.pk)


class JobAttemptStepsSerializer(JobAttemptSerializer):
    """An attempt on the job's detail: with the step it resumed from and the furthest step it reported."""

    start_step = serializers.IntegerField(help_text="The checkpoint step it resumed from (0: from scratch).")
    reached_step = serializers.IntegerField(allow_null=True, help_text="The furthest step it reported or checkpointed.")

    class Meta(JobAttemptSerializer.Meta):
        fields = [*JobAttemptSerializer.Meta.fields, "start_step", "reached_step"]


class GangMemberSerializer(Serializer):
    worker_id = serializers.CharField(allow_null=True)
    worker_name = serializers.CharField()
    rank = serializers.IntegerField()
    gpu_indices = serializers.ListField(child=serializers.IntegerField(), allow_null=True, help_text="Null: the whole worker.")
    acknowledged = serializers.BooleanField()
    outcome = serializers.CharField(help_text="Empty while it runs; completed, failed, cancelled, lost or stopped.")


class JobDetailSerializer(JobSerializer):
    attempts = serializers.SerializerMethodField()
    artifacts = serializers.SerializerMethodField()
    members = serializers.SerializerMethodField(
        help_text="A multi-node job's members in its current (else latest) attempt, rank 0 first; [] for others."
    )
    master_port = serializers.IntegerField(read_only=True, allow_null=True, help_text="A multi-node job's rendezvous port.")

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "master_port", "members", "attempts", "artifacts"]
        read_only_fields = fields

    @extend_schema_field(GangMemberSerializer(many=True))
    def get_members(self, job):
        return gangs.members_of_latest(job)

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
        return ArtifactSerializer(artifacts_for_job(job.pk), many=True, context=self.context).data


class JobSubmittedSerializer(JobSerializer):
    """The submit response (documentation only): the job plus ``job_id`` and whether it went out at once."""

    job_id = serializers.CharField(read_only=True)
    dispatched = serializers.BooleanField(read_only=True)

    class Meta(JobSerializer.Meta):
        fields = [*JobSerializer.Meta.fields, "job_id", "dispatched"]
        read_only_fields = fields
