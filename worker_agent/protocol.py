"""The wire contract between the orchestrator and its worker agents: the one place its strings live.

Imported by the agent (this package, which never imports Django) and by the server alike. It names
the HTTP paths and header, the SSE event types and their payloads, the statuses an agent reports,
the fields of each request and response (as TypedDicts), and the machine-readable codes of every
refusal an agent acts on. SimpleTuner's own agent speaks a subset of it (``UPSTREAM-PROTOCOL.md``):
nothing here may change a name that agent sends or reads.
"""

from typing import Literal, TypedDict  # no NotRequired: the agent supports Python 3.10

# --- HTTP ----------------------------------------------------------------------------------------

WORKER_TOKEN_HEADER = "X-Worker-Token"
# Our agent's own process instance: a random id sent on every request, the same for the process's life. A
# stream or registration with another instance (or none, as SimpleTuner's released agent sends) is another
# agent on the worker's token, which takes the worker over; one with the same instance is a reconnect.
AGENT_INSTANCE_HEADER = "X-Agent-Instance"
AGENT_INSTANCE_MAX_CHARS = 64  # letters, digits, "-" and "_"
API_PREFIX = "/api/workers/"
REGISTER_PATH = "/api/workers/register"
HEARTBEAT_PATH = "/api/workers/heartbeat"
STREAM_PATH = "/api/workers/stream"
QUEUE_PATH = "/api/workers/queue"
DISCONNECT_PATH = "/api/workers/disconnect"
JOB_STATUS_PATH = "/api/workers/job/{job_id}/status"


def job_status_path(job_id):
    """Return the path an agent POSTs ``job_id``'s status reports to."""
    return JOB_STATUS_PATH.format(job_id=job_id)


# --- the artifact store (S3-style, as SimpleTuner's own orchestrator serves it) ------------------

# A trainer PUTs (and a resuming agent GETs) ``{upload_endpoint}/{bucket}/{key}`` with its attempt's token.
UPLOAD_PATH = "/api/cloud/storage"
UPLOAD_TOKEN_HEADER = "X-Upload-Token"
UPLOAD_SECRET_HEADER = "X-SimpleTuner-Secret"  # the same token, as SimpleTuner's publishing providers send it
# POST: the attempt declares the checkpoint of ``step`` complete (all its files uploaded).
CHECKPOINT_COMPLETE_PATH = "/api/cloud/checkpoints/{step}/complete"
# On a PUT of a checkpoint's file: the uploader declares that checkpoint complete itself once all its files are
# stored (our agent, for a trainer's finished checkpoint); until then the attempt speaking does not complete it.
CHECKPOINT_DECLARES_HEADER = "X-Checkpoint-Declares"
# What the agent hands the trainer (SimpleTuner reads these names).
UPLOAD_ENDPOINT_ENV = "SIMPLETUNER_UPLOAD_ENDPOINT"
UPLOAD_TOKEN_ENV = "SIMPLETUNER_UPLOAD_TOKEN"
# The config key SimpleTuner resumes from: a checkpoint directory's name inside ``output_dir``.
RESUME_CONFIG_KEY = "resume_from_checkpoint"
OUTPUT_DIR_CONFIG_KEY = "output_dir"
# A checkpoint is the files under a path segment named so (SimpleTuner's own layout).
CHECKPOINT_PREFIX = "checkpoint-"
KEY_MAX_CHARS = 1024


def checkpoint_complete_path(step):
    """Return the path an attempt POSTs to declare its checkpoint of ``step`` complete."""
    return CHECKPOINT_COMPLETE_PATH.format(step=int(step))


def checkpoint_step(key):
    """Return ``(step, index of the segment)`` of the last ``checkpoint-<step>`` segment of ``key``'s
    directories, or None when the key is no checkpoint file."""
    segments = key.split("/")
    for index in range(len(segments) - 2, -1, -1):
        segment = segments[index]
        digits = segment[len(CHECKPOINT_PREFIX) :]
        if segment.startswith(CHECKPOINT_PREFIX) and digits.isascii() and digits.isdigit() and len(digits) <= 18:
            return int(digits), index
    return None


def checkpoint_relative_path(key):
    """Return ``checkpoint-<step>/...``: where a checkpoint file of ``key`` goes inside ``output_dir``."""
    found = checkpoint_step(key)
    if found is None:
        raise ValueError(f"{key!r} is not a checkpoint file")
    return "/".join(key.split("/")[found[1] :])


# --- SSE events (carried as the `event:` field and as `type` in the JSON data) ------------------

JOB_SUBMIT = "job_submit"
JOB_CANCEL = "job_cancel"
DRAIN = "drain"
SHUTDOWN = "shutdown"
PING = "ping"  # the upstream agent's keep-alive; ours ignores it
# Sent by django-eventstream itself: an unknown Last-Event-ID (typed by our stream view), and keep-alives.
STREAM_RESET = "stream-reset"
KEEP_ALIVE = "keep-alive"
STREAM_OPEN = "stream-open"  # django-eventstream's first event on every stream, without data

EventType = Literal["job_submit", "job_cancel", "drain", "shutdown", "ping", "stream-reset"]


class _JobSubmitEventBase(TypedDict):
    type: Literal["job_submit"]
    job_id: str
    config_name: str
    config: dict
    dataloader: dict | list | None
    upload_endpoint: str  # the upstream agent reads it without a default: always present
    upload_token: str  # this attempt's own: valid only while the attempt holds the job
    attempt: str  # the attempt's lease id: echoed in every report about this attempt
    attempt_number: int
    resume: "ResumeCheckpoint | None"  # the latest complete checkpoint of an earlier attempt, if any


class JobSubmitEvent(_JobSubmitEventBase, total=False):
    """Sent only to an agent that registered with ``max_jobs`` (ours): where on the worker, and with whom, the job runs.

    ``gpu_indices``: the worker's GPUs (out of its ``gpu_slots``) this job runs on: the trainer's
    CUDA_VISIBLE_DEVICES, and the config's ``accelerate_visible_devices``; absent, the job has the whole worker.
    A multi-node job (``num_nodes`` > 1) also carries this member's ``node_rank``, and rank 0's
    ``master_addr`` and ``master_port`` (GANG_ENV and GANG_CONFIG_KEYS say where each goes).
    """

    gpu_indices: list  # of int
    num_nodes: int
    node_rank: int
    master_addr: str
    master_port: int


class CheckpointFile(TypedDict):
    key: str
    size: int
    sha256: str
    download_url: str  # a path under UPLOAD_PATH: GET it with this attempt's upload token


class ResumeCheckpoint(TypedDict):
    step: int
    checkpoint: str  # the directory's name, ``checkpoint-<step>``: SimpleTuner's resume_from_checkpoint
    attempt: int  # the number of the attempt that wrote it
    files: list  # of CheckpointFile


class UploadResponse(TypedDict):
    Key: str
    Bucket: str
    ETag: str
    key: str  # the artifact's key in the job's namespace
    size: int
    sha256: str
    attempt: int
    checkpoint_step: int | None


class JobCancelEvent(TypedDict):
    type: Literal["job_cancel"]
    job_id: str
    attempt: str | None


class _DrainEventBase(TypedDict):
    type: Literal["drain"]
    current_job_id: str | None


class DrainEvent(_DrainEventBase, total=False):
    job_ids: list  # every job the worker runs: an agent with ``max_jobs`` finishes each (and leaves as drain says)


class _ShutdownEventBase(TypedDict):
    type: Literal["shutdown"]
    reason: str  # for people; the upstream agent reads it at the top level


class ShutdownEvent(_ShutdownEventBase, total=False):
    code: str  # one of SHUTDOWN_CODES: what an agent decides on
    agent_name: str  # AGENT_REPLACED: the name the agent that took over registered with (its --name)
    agent_host: str  # AGENT_REPLACED: and its host


# Why the orchestrator ends a worker's stream for good (the ``code`` of a ``shutdown`` event).
TOKEN_REVOKED = "token_revoked"  # rotated or re-issued: the agent needs a new token
WORKER_DELETED = "worker_deleted"  # the worker no longer exists: the agent needs a new registration
# Another agent registered or opened a stream with this worker's token and serves it now: this one must stop
# (it gets no job any more; a job it ran was taken back when the other agent registered).
AGENT_REPLACED = "agent_replaced"
SHUTDOWN_CODES = frozenset({TOKEN_REVOKED, WORKER_DELETED, AGENT_REPLACED})
# Shutdown codes after which retrying with the same token can never succeed.
CREDENTIAL_SHUTDOWN_CODES = frozenset({TOKEN_REVOKED, WORKER_DELETED})


# --- what an agent reports -----------------------------------------------------------------------

# Job statuses an agent reports on job_status_path(); the first three all mean "running".
STARTING = "starting"
TRAINING = "training"
RUNNING = "running"
COMPLETED = "completed"
FAILED = "failed"
CANCELLED = "cancelled"
REPORTED_STATUSES = (STARTING, TRAINING, RUNNING, COMPLETED, FAILED, CANCELLED)
RUNNING_STATUSES = frozenset({STARTING, TRAINING, RUNNING})
RESULT_STATUSES = frozenset({COMPLETED, FAILED, CANCELLED})  # an attempt's end: reported once, retried until answered
ReportedStatus = Literal["starting", "training", "running", "completed", "failed", "cancelled"]

# The agent's own state in a heartbeat.
AGENT_IDLE = "idle"
AGENT_BUSY = "busy"
AgentStatus = Literal["idle", "busy"]

# Utilisation a heartbeat may carry (the server keeps the latest as the worker's metrics).
HEARTBEAT_METRIC_FIELDS = (
    "gpu_utilization",
    "gpu_memory_used_gb",
    "gpu_memory_total_gb",
    "gpus",
    "cpu_percent",
    "memory_percent",
    "memory_used_gb",
    "load_average",
)


MAX_JOBS_MAX = 64  # the most jobs one worker runs side by side: an agent with more GPU slots offers this many


class RunningJob(TypedDict):
    job_id: str
    attempt: str | None


class RegisterRequest(TypedDict, total=False):
    name: str
    worker_id: str | None
    persistent: bool | None
    current_job_id: str | None  # the job the agent still runs, if any (with max_jobs: the first of running_jobs)
    current_attempt: str | None  # and the attempt (lease) it runs it under
    # Ours: several jobs at once. ``max_jobs`` > 1 says the agent runs that many jobs side by side, each on its own
    # GPUs out of ``gpu_slots`` (the indices it may use: --gpus; all it sees by default); ``gpu_slots_declared``
    # is true when no NVIDIA GPU backs them (declared on a CPU node, or in tests). ``running_jobs``: every job it
    # runs or holds the result of, with its attempt. ``advertise_address``: where other workers reach this one for
    # a multi-node job's rendezvous (--advertise-address; absent: the address the orchestrator sees it at).
    max_jobs: int
    gpu_slots: list  # of int
    gpu_slots_declared: bool
    running_jobs: list  # of RunningJob
    advertise_address: str
    # Ours: the agent runs a member of a multi-node job (a job_submit's num_nodes, node_rank, master_addr,
    # master_port). SimpleTuner's released agent does not say so, and is never made a member of one.
    multi_node: bool
    gpu_info: dict | None  # the upstream agent's nested capabilities: name, vram_gb, count, driver, accelerator
    gpu_count: int  # the spec's flat capabilities (either shape is accepted)
    gpu_name: str
    gpu_vram_gb: float
    accelerator_type: str
    gpus: list
    driver_version: str | None
    cuda_version: str | None
    hostname: str
    agent_version: str


# The worker's type in a registration's answer (``worker_type``): a persistent worker (and the orchestrator's
# built-in local one) stays between jobs; an ephemeral one runs one job, then leaves.
WORKER_PERSISTENT = "persistent"
WORKER_EPHEMERAL = "ephemeral"
WORKER_LOCAL = "local"


class ResumeJob(TypedDict):
    job_id: str
    status: str
    attempt: str | None
    attempt_number: int


class _RegisterResponseBase(TypedDict):
    worker_id: str
    status: str
    worker_type: str  # WORKER_PERSISTENT, WORKER_EPHEMERAL or WORKER_LOCAL
    draining: bool
    sse_url: str
    heartbeat_interval: float
    dispatch_ack_timeout: float  # seconds the server waits for a dispatch's acknowledgement before requeueing it


class RegisterResponse(_RegisterResponseBase, total=False):
    name: str  # the name operators know the worker by (the agent's own --name may differ)
    resume_job: ResumeJob  # the job it reported is still its own: carry on
    abandon_job: str  # the job it reported is not its own any more: stop it
    # To an agent that registered with max_jobs: the same for each of its running_jobs, and the most jobs it is sent
    # at once (1 from an orchestrator that does not pack; the agent then runs one job at a time, as SimpleTuner's does).
    resume_jobs: list  # of ResumeJob
    abandon_jobs: list  # of job ids
    max_jobs: int


class HeartbeatJob(TypedDict, total=False):
    job_id: str
    attempt: str | None  # naming it acknowledges that job's dispatch, as ``attempt`` does for current_job_id
    progress: dict | float | None
    log_tail: list | str | None


class HeartbeatRequest(TypedDict, total=False):
    worker_id: str | None
    status: AgentStatus  # busy while any job runs
    current_job_id: str | None
    attempt: str | None  # the attempt of current_job_id; naming it acknowledges a dispatch
    progress: dict | float | None
    log_tail: list | str | None
    jobs: list  # of HeartbeatJob: with max_jobs, every job the agent runs (current_job_id is the first)
    # plus any of HEARTBEAT_METRIC_FIELDS


class _HeartbeatResponseBase(TypedDict):
    status: str
    draining: bool
    current_job_id: str | None
    current_attempt: str | None  # the attempt of the job the heartbeat named; another one was not acknowledged


class HeartbeatResponse(_HeartbeatResponseBase, total=False):
    jobs: list  # of RunningJob: to a heartbeat with ``jobs``, every job the orchestrator holds on the worker


# --- several jobs per worker, jobs across workers: what the trainer is given --------------------------------
# The trainer's environment: its GPUs, and for a multi-node job the rendezvous as torchrun names it.
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
GANG_ENV = {"master_addr": "MASTER_ADDR", "master_port": "MASTER_PORT", "node_rank": "NODE_RANK", "num_nodes": "NNODES"}
# SimpleTuner's config keys (its DISTRIBUTED.md), written in the config's own style (``--key`` or ``key``):
# the GPUs and processes of this node, and for a multi-node job the machines and the rendezvous.
VISIBLE_DEVICES_CONFIG_KEY = "accelerate_visible_devices"
NUM_PROCESSES_CONFIG_KEY = "num_processes"  # GPUs of this node x num_nodes
GANG_CONFIG_KEYS = {
    "num_nodes": "num_machines",
    "node_rank": "machine_rank",
    "master_addr": "main_process_ip",
    "master_port": "main_process_port",
}
SAME_NETWORK_CONFIG_KEY = "same_network"  # true for a multi-node job


class JobReport(TypedDict, total=False):
    status: ReportedStatus
    attempt: str | None  # the lease of the attempt reported on; fences reports of older attempts
    error: str | None
    progress: dict | float | None
    exit_code: int | None
    log_tail: list | str | None
    log_lines: "LogLines"  # the attempt's output lines not yet accepted (ours; the upstream agent sends none)
    journal: bool  # the outcome was read back from the agent's job directory after the agent restarted


class LogLines(TypedDict):
    """A run of an attempt's output lines: ``lines`` are its lines number ``from``, ``from + 1``, ... (0 is
    the attempt's first line; progress lines are not counted). The orchestrator keeps each line once."""

    # "from" is a keyword: the key is written as a string wherever it is used
    lines: list


LOG_LINES_FROM = "from"
LOG_CHUNK_MAX_LINES = 2000  # per report (a line is at most 2,000 characters: well under the request limit)


# The reason a report read back from an agent's journal gives in the job's audit trail.
FROM_JOURNAL = "from the agent's journal"

# The exit codes a report may carry: a shell's (0-255, 128+N for signal N), a negative one, or a Windows
# one such as 0xC0000005 (3221225477, an access violation). Others are left out of a report.
EXIT_CODE_MIN = -(2**31)
EXIT_CODE_MAX = 2**32 - 1
MINIMAL_ERROR_MAX_CHARS = 500


def minimal_report(report):
    """Return the smallest form of the result ``report`` (a JobReport of a RESULT_STATUSES status).

    The way out when the orchestrator refuses a result as sent (a 4xx other than 401, 403 and 409): it
    keeps ``status``, ``attempt``, ``journal``, ``exit_code`` when it is an integer in range and the
    start of ``error`` with control characters, NUL and unpaired surrogates replaced; no progress, no
    log. The orchestrator always accepts it, so a job whose trainer ended never stays running.
    """
    minimal: JobReport = {"status": report["status"], "attempt": report.get("attempt")}
    code = report.get("exit_code")
    if isinstance(code, int) and not isinstance(code, bool) and EXIT_CODE_MIN <= code <= EXIT_CODE_MAX:
        minimal["exit_code"] = code
    error = report.get("error")
    if error:
        text = str(error)[:MINIMAL_ERROR_MAX_CHARS]
        minimal["error"] = "".join(c if c.isprintable() else " " if c.isspace() else "\ufffd" for c in text)
    if report.get("journal"):
        minimal["journal"] = True
    return minimal


class JobReportResponse(TypedDict):
    job_id: str
    status: str
    accepted: bool


class QueueResponse(TypedDict):
    has_jobs: bool


# --- refusals an agent acts on (the ``code`` of a JSON error body) ------------------------------

# 409 on a report or heartbeat: this job is not (or no longer) the agent's to run. Stop it, don't report.
JOB_NOT_OWNED = "job_not_owned"
STALE_ATTEMPT = "stale_attempt"
# 409 on a running report: the job was cancelled; stop it and report ``cancelled``.
JOB_CANCELLED = "job_cancelled"
STALE_REPORT_CODES = frozenset({JOB_NOT_OWNED, STALE_ATTEMPT, JOB_CANCELLED})
# 401: the token is missing, unknown or revoked.
NOT_AUTHENTICATED = "not_authenticated"
# Refusals of an upload (besides 401 NOT_AUTHENTICATED and 409 STALE_ATTEMPT): 400 and 413. Not retried.
INVALID_KEY = "invalid_key"
UPLOAD_TOO_LARGE = "upload_too_large"
QUOTA_EXCEEDED = "quota_exceeded"
