"""Request and response shapes of the worker and admin-worker APIs."""

from drf_spectacular.utils import extend_schema_field
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
from ..selectors import held_jobs
from ..streams import serving_entry

WORKER_NAME_MAX_CHARS = Worker._meta.get_field("name").max_length
LOG_LINE_MAX_CHARS = 2000  # as the agent cuts them (worker_agent.runner.MAX_LINE_CHARS)
ID_MAX_CHARS = 64  # worker, job and attempt ids (the longest column is 40)
MAX_JOBS_MAX = protocol.MAX_JOBS_MAX  # jobs one worker may run side by side


class WorkerSerializer(ModelSerializer):
    current_job_id = serializers.CharField(read_only=True, allow_null=True)
    draining = serializers.SerializerMethodField()
    stream_connected = serializers.SerializerMethodField()
    open_streams = serializers.SerializerMethodField(help_text="How many SSE streams are open for this worker.")
    serving_agent = serializers.SerializerMethodField(
        help_text="The agent whose stream serves this worker (the newest agent on its token): its name, host and "
        "instance (None for an agent that sends none); null without an open stream."
    )
    url = serializers.SerializerMethodField(help_text="This worker's own address in the API.")
    agent_notes = serializers.SerializerMethodField(
        help_text="Where the agent's own --name or --persistent differs from the worker (the worker's win)."
    )
    gpus_free = serializers.SerializerMethodField(
        help_text="GPUs a new job may take now: a packing worker's free slots (0 at max_jobs jobs); one that does not "
        "pack, all its GPUs while it is idle with no job, else 0."
    )
    running_jobs = serializers.SerializerMethodField(
        help_text="The jobs on the worker and their GPU indices (null: the whole worker)."
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
            "max_jobs",
            "gpu_slots",
            "gpu_slots_declared",
            "gpus_free",
            "running_jobs",
            "draining",
            "stream_connected",
            "open_streams",
            "serving_agent",
            "last_heartbeat",
            "connected_at",
            "status_changed_at",
            "created_at",
        ]
        read_only_fields = fields

    def get_gpus_free(self, worker) -> int:
        if worker.packs:
            return worker.gpus_free
        return worker.gpu_count if worker.status == "idle" and worker.current_job_id is None else 0

    def get_running_jobs(self, worker) -> list[dict]:
        """The worker's jobs: its current job (the whole worker), or a packing worker's jobs and gang members on their
        GPUs, read from ``held_jobs`` where the list attached them (``workers.selectors.held_jobs_attach``), else
        through ``workers.selectors.held_jobs``."""
        if not worker.packs:
            return [{"job_id": worker.current_job_id, "gpu_indices": None}] if worker.current_job_id else []
        if not hasattr(worker, "held_jobs"):
            if worker.status not in ("busy", "draining"):  # an idle or offline one holds none: no read
                return []
            worker.held_jobs = held_jobs(worker)
        return [{"job_id": job.pk, "gpu_indices": job.gpu_indices} for job in worker.held_jobs]

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

    def get_serving_agent(self, worker) -> dict | None:
        entry = serving_entry(worker)
        return None if entry is None else {key: entry.get(key) for key in ("name", "host", "instance")}


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


@extend_schema_field(
    {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": GPU_COUNT_MAX - 1},
        "maxItems": GPU_COUNT_MAX,
        "uniqueItems": True,
    }
)
class GpuSlots(serializers.ListField):
    """A worker's GPU slots: distinct GPU indices from 0 to GPU_COUNT_MAX - 1 (at most GPU_COUNT_MAX of them)."""

    def __init__(self, **kwargs):
        super().__init__(child=BoundedInt(min_value=0, max_value=GPU_COUNT_MAX - 1), max_length=GPU_COUNT_MAX, **kwargs)

    def to_internal_value(self, data):
        value = super().to_internal_value(data)
        if len(set(value)) != len(value):
            raise serializers.ValidationError("GPU slots must be distinct GPU indices.")
        return value


class RunningJobSerializer(Serializer):
    job_id = BoundedText(max_length=ID_MAX_CHARS)
    attempt = BoundedText(required=False, allow_null=True, allow_blank=True, max_length=ID_MAX_CHARS)


class HeartbeatJobSerializer(Serializer):
    job_id = BoundedText(max_length=ID_MAX_CHARS)
    attempt = BoundedText(required=False, allow_null=True, allow_blank=True, max_length=ID_MAX_CHARS)
    progress = TrainerJSON(required=False, allow_null=True)
    log_tail = TrainerLog(required=False, allow_null=True, max_length=LOG_TAIL_MAX_CHARS)


class RegisterSerializer(Serializer):
    """Both the spec's flat capability fields and the upstream agent's ``gpu_info`` are accepted.

    ``gpu_info``'s own fields (``count``, ``vram_gb``...) are bounded like the flat ones by
    ``workers.capabilities.parse_capabilities`` (code ``invalid_capabilities``)."""

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
    # Packing (protocol.RegisterRequest): several jobs at once, each on its own GPUs out of gpu_slots.
    max_jobs = BoundedInt(
        required=False, min_value=1, max_value=MAX_JOBS_MAX, help_text="Jobs the agent runs side by side (absent: one)."
    )
    gpu_slots = GpuSlots(required=False, help_text="The GPU indices the agent's jobs may use (distinct, from 0).")
    gpu_slots_declared = StrictBoolean(required=False, help_text="No NVIDIA GPU backs the slots (a CPU node, tests).")
    running_jobs = serializers.ListField(
        child=RunningJobSerializer(), required=False, max_length=MAX_JOBS_MAX, help_text="Every job the agent runs."
    )
    advertise_address = BoundedText(required=False, allow_blank=True, max_length=255)
    multi_node = StrictBoolean(required=False, help_text="The agent runs a member of a multi-node job (ours).")


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
    jobs = serializers.ListField(
        child=HeartbeatJobSerializer(),
        required=False,
        max_length=MAX_JOBS_MAX,
        help_text="Every job the agent runs (an agent that registered with max_jobs); answered with every job held here.",
    )


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
    max_jobs = serializers.IntegerField(required=False, help_text="To an agent that sent max_jobs: the jobs it is sent at once.")
    resume_jobs = ResumeJobSerializer(many=True, required=False, help_text="Those of running_jobs still its own: go on.")
    abandon_jobs = serializers.ListField(
        child=serializers.CharField(), required=False, help_text="Those of running_jobs no longer its own: stop them."
    )


class HeartbeatResponseSerializer(Serializer):
    status = serializers.CharField()
    draining = serializers.BooleanField()
    current_job_id = serializers.CharField(allow_null=True)
    current_attempt = serializers.CharField(
        allow_null=True, help_text="The attempt of the job the heartbeat named, as the server holds it."
    )
    jobs = RunningJobSerializer(
        many=True, required=False, help_text="To a heartbeat with jobs: every job held on the worker, with its attempt."
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
