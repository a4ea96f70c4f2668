"""Request and response shapes of the worker and admin-worker APIs."""

from rest_framework import serializers

from common.fields import (
    BoundedFloat,
    BoundedInt,
    BoundedJSON,
    BoundedText,
    Labels,
    StrictBoolean,
    TrainerJSON,
    TrainerLog,
    TrainerLogLines,
    TrainerText,
)
from common.http import api_url
from common.inputs import GPU_COUNT_MAX, GPU_VRAM_GB_MAX, LOG_TAIL_MAX_CHARS, TRAINER_ERROR_MAX_CHARS
from common.serializers import ModelSerializer, Serializer
from worker_agent import protocol

from ..models import Worker, WorkerType

WORKER_NAME_MAX_CHARS = Worker._meta.get_field("name").max_length
LOG_LINE_MAX_CHARS = 2000  # as the agent cuts them (worker_agent.runner.MAX_LINE_CHARS)
ID_MAX_CHARS = 64  # worker, job and attempt ids (the longest column is 40)


class WorkerSerializer(ModelSerializer):
    current_job_id = serializers.CharField(read_only=True, allow_null=True)
    draining = serializers.SerializerMethodField()
    stream_connected = serializers.SerializerMethodField()
    open_streams = serializers.SerializerMethodField(help_text="How many SSE streams are open for this worker.")
    url = serializers.SerializerMethodField(help_text="This worker's own address in the API.")
    agent_notes = serializers.SerializerMethodField(
        help_text="Where the agent's own --name or --persistent differs from the worker (the worker's win)."
    )

    class Meta:
        model = Worker
        fields = [
            "id",
            "url",
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
            "agent_name",
            "agent_persistent",
            "agent_notes",
            "metrics",
            "current_job_id",
            "draining",
            "stream_connected",
            "open_streams",
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

    def get_agent_notes(self, worker) -> list[str]:
        return worker.agent_notes()

    def get_url(self, worker) -> str:
        return api_url(self.context.get("request"), "admin-worker", worker_id=worker.pk)

    def get_open_streams(self, worker) -> int:
        return max(len(worker.open_streams or ()), int(worker.stream_id is not None))


class WorkerCreateSerializer(Serializer):
    name = BoundedText(max_length=WORKER_NAME_MAX_CHARS)
    worker_type = serializers.ChoiceField(
        choices=[WorkerType.EPHEMERAL, WorkerType.PERSISTENT], default=WorkerType.PERSISTENT
    )
    labels = Labels(required=False, help_text="Name -> value; the rules: docs/api.md, Limits.")


class WorkerCreatedSerializer(WorkerSerializer):
    worker_id = serializers.CharField(source="id", read_only=True)
    token = serializers.SerializerMethodField()

    class Meta(WorkerSerializer.Meta):
        fields = ["worker_id", "token", *WorkerSerializer.Meta.fields]
        read_only_fields = fields

    def get_token(self, worker) -> str:
        return self.context["token"]


class RegisterSerializer(Serializer):
    """Both the spec's flat capability fields and the upstream agent's ``gpu_info`` are accepted.

    ``gpu_info``'s own fields (``count``, ``vram_gb``...) are bounded like the flat ones by
    ``workers.services.parse_capabilities`` (code ``invalid_capabilities``)."""

    name = BoundedText(required=False, allow_blank=True, max_length=WORKER_NAME_MAX_CHARS)
    worker_id = BoundedText(required=False, allow_null=True, max_length=ID_MAX_CHARS)
    gpu_info = BoundedJSON(required=False, allow_null=True, types=(dict,), max_bytes="MAX_GPU_INFO_BYTES")
    gpu_count = BoundedInt(required=False, allow_null=True, min_value=0, max_value=GPU_COUNT_MAX)
    gpu_name = BoundedText(required=False, allow_null=True, allow_blank=True, max_length=200)
    gpu_vram_gb = BoundedFloat(required=False, allow_null=True, min_value=0, max_value=GPU_VRAM_GB_MAX)
    accelerator_type = BoundedText(required=False, allow_null=True, allow_blank=True, max_length=32)
    persistent = StrictBoolean(required=False, allow_null=True)
    current_job_id = BoundedText(required=False, allow_null=True, allow_blank=True, max_length=ID_MAX_CHARS)
    current_attempt = BoundedText(required=False, allow_null=True, allow_blank=True, max_length=ID_MAX_CHARS)
    hostname = BoundedText(required=False, allow_blank=True, max_length=255)
    agent_version = BoundedText(required=False, allow_blank=True, max_length=64)
    gpus = BoundedJSON(required=False, types=(list,), max_bytes="MAX_GPU_INFO_BYTES")
    driver_version = BoundedText(required=False, allow_null=True, allow_blank=True, max_length=64)
    cuda_version = BoundedText(required=False, allow_null=True, allow_blank=True, max_length=64)


class HeartbeatSerializer(Serializer):
    worker_id = BoundedText(required=False, allow_null=True, max_length=ID_MAX_CHARS)
    status = BoundedText(required=False, allow_null=True, max_length=32)
    current_job_id = BoundedText(required=False, allow_null=True, allow_blank=True, max_length=ID_MAX_CHARS)
    attempt = BoundedText(required=False, allow_null=True, allow_blank=True, max_length=ID_MAX_CHARS)
    progress = TrainerJSON(required=False, allow_null=True)
    log_tail = TrainerLog(required=False, allow_null=True, max_length=LOG_TAIL_MAX_CHARS)
    gpu_utilization = BoundedJSON(required=False, allow_null=True, max_bytes="MAX_GPU_INFO_BYTES")
    gpu_memory_used_gb = BoundedJSON(required=False, allow_null=True, max_bytes="MAX_GPU_INFO_BYTES")
    gpu_memory_total_gb = BoundedJSON(required=False, allow_null=True, max_bytes="MAX_GPU_INFO_BYTES")
    gpus = BoundedJSON(required=False, allow_null=True, max_bytes="MAX_GPU_INFO_BYTES")
    cpu_percent = BoundedFloat(required=False, allow_null=True, min_value=0, max_value=1e9)
    memory_percent = BoundedFloat(required=False, allow_null=True, min_value=0, max_value=1e9)
    memory_used_gb = BoundedFloat(required=False, allow_null=True, min_value=0, max_value=1e12)
    load_average = BoundedJSON(required=False, allow_null=True, max_bytes="MAX_GPU_INFO_BYTES")


# Every utilisation field of the protocol is declared (with its type) above.
assert set(protocol.HEARTBEAT_METRIC_FIELDS) <= set(HeartbeatSerializer._declared_fields)


class JobStatusReportSerializer(Serializer):
    """A report on a job. What the trainer produced (``error``, ``progress``, ``log_tail``) is cleaned and
    kept, never refused; a ``failed`` report with only ``status``, ``attempt``, ``exit_code`` and a short
    ``error`` (the agent's fallback, ``protocol.minimal_report``) is always accepted."""

    status = serializers.ChoiceField(choices=protocol.REPORTED_STATUSES)
    error = TrainerText(required=False, allow_null=True, allow_blank=True, max_length=TRAINER_ERROR_MAX_CHARS)
    progress = TrainerJSON(required=False, allow_null=True)
    attempt = BoundedText(required=False, allow_null=True, allow_blank=True, max_length=ID_MAX_CHARS)
    exit_code = BoundedInt(
        required=False,
        allow_null=True,
        min_value=protocol.EXIT_CODE_MIN,
        max_value=protocol.EXIT_CODE_MAX,
        help_text="The trainer's exit status: a shell's (128+N for signal N), or a Windows one such as 0xC0000005.",
    )
    log_tail = TrainerLog(required=False, allow_null=True, max_length=LOG_TAIL_MAX_CHARS)
    log_lines = TrainerLogLines(
        required=False,
        allow_null=True,
        max_lines=protocol.LOG_CHUNK_MAX_LINES,
        line_chars=LOG_LINE_MAX_CHARS,
        help_text="New lines of the attempt's output, {from: n, lines: [...]}: the orchestrator keeps the whole log.",
    )
    journal = StrictBoolean(
        required=False, default=False, help_text="The outcome was read back from the agent's journal after it restarted."
    )


class WorkerIdSerializer(Serializer):
    worker_id = BoundedText(required=False, allow_null=True, max_length=ID_MAX_CHARS)


# --- response shapes (documentation only: the views return the services' dicts) -----------------


class ResumeJobSerializer(Serializer):
    job_id = serializers.CharField()
    status = serializers.CharField()
    attempt = serializers.CharField()
    attempt_number = serializers.IntegerField()


class RegisterResponseSerializer(Serializer):
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


class HeartbeatResponseSerializer(Serializer):
    status = serializers.CharField()
    draining = serializers.BooleanField()
    current_job_id = serializers.CharField(allow_null=True)
    current_attempt = serializers.CharField(
        allow_null=True, help_text="The attempt of the job the heartbeat named, as the server holds it."
    )


class JobReportResponseSerializer(Serializer):
    job_id = serializers.CharField()
    status = serializers.CharField()
    accepted = serializers.BooleanField()


class QueueStateSerializer(Serializer):
    has_jobs = serializers.BooleanField()


class WorkerStatusSerializer(Serializer):
    status = serializers.CharField()


class WorkerListSerializer(Serializer):
    workers = WorkerSerializer(many=True)


class WorkerTokenSerializer(Serializer):
    worker_id = serializers.CharField()
    name = serializers.CharField()
    token = serializers.CharField(help_text="The new token; shown only this once. The old one stops working.")
    requeued_job = serializers.CharField(
        allow_null=True, help_text="The job the worker was running (force): back on the queue, no retry spent."
    )
