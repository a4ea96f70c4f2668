"""Request and response shapes of the worker and admin-worker APIs."""

from rest_framework import serializers

from worker_agent import protocol

from ..models import Worker, WorkerType


class WorkerSerializer(serializers.ModelSerializer):
    current_job_id = serializers.CharField(read_only=True, allow_null=True)
    draining = serializers.SerializerMethodField()
    stream_connected = serializers.SerializerMethodField()

    class Meta:
        model = Worker
        fields = [
            "id",
            "name",
            "status",
            "worker_type",
            "labels",
            "gpu_count",
            "gpu_name",
            "gpu_vram_gb",
            "accelerator_type",
            "gpu_info",
            "hostname",
            "agent_version",
            "metrics",
            "current_job_id",
            "draining",
            "stream_connected",
            "last_heartbeat",
            "connected_at",
            "status_changed_at",
            "created_at",
        ]
        read_only_fields = fields

    def get_draining(self, worker) -> bool:
        return worker.drain_requested_at is not None

    def get_stream_connected(self, worker) -> bool:
        return worker.stream_id is not None


class WorkerCreateSerializer(serializers.Serializer):
    name = serializers.CharField(max_length=128)
    worker_type = serializers.ChoiceField(
        choices=[WorkerType.EPHEMERAL, WorkerType.PERSISTENT], default=WorkerType.PERSISTENT
    )
    labels = serializers.DictField(child=serializers.CharField(allow_blank=True, max_length=200), required=False)


class WorkerCreatedSerializer(WorkerSerializer):
    worker_id = serializers.CharField(source="id", read_only=True)
    token = serializers.SerializerMethodField()

    class Meta(WorkerSerializer.Meta):
        fields = ["worker_id", "token", *WorkerSerializer.Meta.fields]
        read_only_fields = fields

    def get_token(self, worker) -> str:
        return self.context["token"]


class RegisterSerializer(serializers.Serializer):
    """Both the spec's flat capability fields and the upstream agent's ``gpu_info`` are accepted."""

    name = serializers.CharField(required=False, allow_blank=True, max_length=128)
    worker_id = serializers.CharField(required=False, allow_null=True)
    gpu_info = serializers.DictField(required=False, allow_null=True)
    gpu_count = serializers.IntegerField(required=False, allow_null=True, min_value=0)
    gpu_name = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=200)
    gpu_vram_gb = serializers.FloatField(required=False, allow_null=True, min_value=0)
    accelerator_type = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=32)
    persistent = serializers.BooleanField(required=False, allow_null=True)
    current_job_id = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=64)
    current_attempt = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=40)
    hostname = serializers.CharField(required=False, allow_blank=True, max_length=255)
    agent_version = serializers.CharField(required=False, allow_blank=True, max_length=64)
    gpus = serializers.ListField(child=serializers.DictField(), required=False)
    driver_version = serializers.CharField(required=False, allow_null=True, allow_blank=True)
    cuda_version = serializers.CharField(required=False, allow_null=True, allow_blank=True)


class HeartbeatSerializer(serializers.Serializer):
    worker_id = serializers.CharField(required=False, allow_null=True)
    status = serializers.CharField(required=False, allow_null=True, max_length=32)
    current_job_id = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=64)
    attempt = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=40)
    progress = serializers.JSONField(required=False, allow_null=True)
    log_tail = serializers.JSONField(required=False, allow_null=True)
    gpu_utilization = serializers.JSONField(required=False, allow_null=True)
    gpu_memory_used_gb = serializers.JSONField(required=False, allow_null=True)
    gpu_memory_total_gb = serializers.JSONField(required=False, allow_null=True)
    gpus = serializers.JSONField(required=False, allow_null=True)
    cpu_percent = serializers.FloatField(required=False, allow_null=True)
    memory_percent = serializers.FloatField(required=False, allow_null=True)
    memory_used_gb = serializers.FloatField(required=False, allow_null=True)
    load_average = serializers.JSONField(required=False, allow_null=True)


# Every utilisation field of the protocol is declared (with its type) above.
assert set(protocol.HEARTBEAT_METRIC_FIELDS) <= set(HeartbeatSerializer._declared_fields)


class JobStatusReportSerializer(serializers.Serializer):
    status = serializers.ChoiceField(choices=protocol.REPORTED_STATUSES)
    error = serializers.CharField(required=False, allow_null=True, allow_blank=True)
    progress = serializers.JSONField(required=False, allow_null=True)
    attempt = serializers.CharField(required=False, allow_null=True, allow_blank=True, max_length=40)
    exit_code = serializers.IntegerField(required=False, allow_null=True)
    log_tail = serializers.JSONField(required=False, allow_null=True)
    journal = serializers.BooleanField(
        required=False, default=False, help_text="The outcome was read back from the agent's journal after it restarted."
    )


class WorkerIdSerializer(serializers.Serializer):
    worker_id = serializers.CharField(required=False, allow_null=True)


# --- response shapes (documentation only: the views return the services' dicts) -----------------


class ResumeJobSerializer(serializers.Serializer):
    job_id = serializers.CharField()
    status = serializers.CharField()
    attempt = serializers.CharField()
    attempt_number = serializers.IntegerField()


class RegisterResponseSerializer(serializers.Serializer):
    worker_id = serializers.CharField()
    status = serializers.CharField()
    worker_type = serializers.CharField()
    draining = serializers.BooleanField()
    sse_url = serializers.URLField(help_text="Open this URL (GET, same token) to receive jobs.")
    heartbeat_interval = serializers.FloatField(help_text="Seconds between heartbeats.")
    dispatch_ack_timeout = serializers.FloatField(
        help_text="Seconds a dispatch may go unacknowledged (no `starting`, and no heartbeat, register or report naming it) before it is requeued."
    )
    resume_job = ResumeJobSerializer(required=False, help_text="The reported job is still this worker's: go on.")
    abandon_job = serializers.CharField(required=False, help_text="The reported job is no longer this worker's.")


class HeartbeatResponseSerializer(serializers.Serializer):
    status = serializers.CharField()
    draining = serializers.BooleanField()
    current_job_id = serializers.CharField(allow_null=True)
    current_attempt = serializers.CharField(
        allow_null=True, help_text="The attempt of the job the heartbeat named, as the server holds it."
    )


class JobReportResponseSerializer(serializers.Serializer):
    job_id = serializers.CharField()
    status = serializers.CharField()
    accepted = serializers.BooleanField()


class QueueStateSerializer(serializers.Serializer):
    has_jobs = serializers.BooleanField()


class WorkerStatusSerializer(serializers.Serializer):
    status = serializers.CharField()


class WorkerListSerializer(serializers.Serializer):
    workers = WorkerSerializer(many=True)


class WorkerTokenSerializer(serializers.Serializer):
    worker_id = serializers.CharField()
    name = serializers.CharField()
    token = serializers.CharField(help_text="The new token; shown only this once. The old one stops working.")
