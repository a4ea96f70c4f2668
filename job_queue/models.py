"""Training jobs, their dispatch attempts, and the matching rules between jobs and workers."""

import fnmatch
import secrets

from django.conf import settings
from django.db import models
from django.db.models.functions import Coalesce

from worker_agent import protocol
from workers.models import WorkerType


def new_job_id():
    return "j_" + secrets.token_hex(8)


def new_lease_id():
    return "a_" + secrets.token_hex(8)


class JobTarget(models.TextChoices):
    WORKER = "worker", "Remote worker"
    LOCAL = "local", "Orchestrator's own machine"
    AUTO = "auto", "Worker if available, else local"


class JobStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    DISPATCHED = "dispatched", "Dispatched"
    RUNNING = "running", "Running"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"


JOB_ACTIVE = frozenset({JobStatus.DISPATCHED, JobStatus.RUNNING})
JOB_TERMINAL = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})
# Finished jobs an operator may retry: a retry is a new job with the same settings (a finished job never reopens).
JOB_RETRYABLE = frozenset({JobStatus.FAILED, JobStatus.CANCELLED})

# Allowed transitions: target -> statuses it may be entered from.
JOB_TRANSITIONS = {
    JobStatus.DISPATCHED: frozenset({JobStatus.QUEUED}),
    JobStatus.RUNNING: frozenset({JobStatus.DISPATCHED}),
    # Back to the queue: the attempt was lost (worker gone, dispatch never acknowledged).
    JobStatus.QUEUED: frozenset({JobStatus.DISPATCHED, JobStatus.RUNNING}),
    # From queued only when a lost attempt's completion arrives late, before a new dispatch; from failed only when
    # that loss had failed the job for good, its retries used up (jobs_recover_completion).
    JobStatus.COMPLETED: frozenset({JobStatus.QUEUED, JobStatus.DISPATCHED, JobStatus.RUNNING, JobStatus.FAILED}),
    JobStatus.FAILED: frozenset({JobStatus.QUEUED, JobStatus.DISPATCHED, JobStatus.RUNNING}),
    JobStatus.CANCELLED: frozenset({JobStatus.QUEUED, JobStatus.DISPATCHED, JobStatus.RUNNING}),
}

# What each status a worker may report (``worker_agent.protocol.REPORTED_STATUSES``) means for the job.
REPORTED_STATUS = {
    protocol.STARTING: JobStatus.RUNNING,
    protocol.TRAINING: JobStatus.RUNNING,
    protocol.RUNNING: JobStatus.RUNNING,
    protocol.COMPLETED: JobStatus.COMPLETED,
    protocol.FAILED: JobStatus.FAILED,
    protocol.CANCELLED: JobStatus.CANCELLED,
}
assert set(REPORTED_STATUS) == set(protocol.REPORTED_STATUSES)

# Which worker types may run a job of each target. `auto` prefers remote workers (ordered first).
TARGET_WORKER_TYPES = {
    JobTarget.WORKER: (WorkerType.EPHEMERAL, WorkerType.PERSISTENT),
    JobTarget.LOCAL: (WorkerType.LOCAL,),
    JobTarget.AUTO: (WorkerType.EPHEMERAL, WorkerType.PERSISTENT, WorkerType.LOCAL),
}


def targets_for_worker_type(worker_type):
    """Return the job targets a worker of ``worker_type`` may run."""
    return [target for target, types in TARGET_WORKER_TYPES.items() if worker_type in types]


class Job(models.Model):
    id = models.CharField(primary_key=True, max_length=32, default=new_job_id, editable=False)
    config_name = models.CharField(max_length=255)
    training_config = models.ForeignKey(
        "configs.TrainingConfig",
        null=True,
        blank=True,
        on_delete=models.PROTECT,
        related_name="jobs",
        help_text="The stored config version the job runs; empty when its config_name is not stored.",
    )
    config = models.JSONField(default=dict, blank=True)
    dataloader = models.JSONField(null=True, blank=True)
    target = models.CharField(max_length=8, choices=JobTarget.choices, default=JobTarget.WORKER)
    worker_labels = models.JSONField(default=dict, blank=True, help_text="Label -> glob pattern, all must match.")
    gpu_count = models.PositiveIntegerField(default=0, help_text="GPUs required; 0 means any worker.")
    # A multi-node job (job_queue.gangs): the workers it runs on at once, each giving it gpu_count GPUs; and the port
    # its rank 0 listens on for the others, assigned at each dispatch (null while it is not dispatched as a gang).
    num_nodes = models.PositiveIntegerField(default=1, help_text="Workers the job runs on at once (a gang when > 1).")
    master_port = models.PositiveIntegerField(null=True, blank=True)
    priority = models.IntegerField(default=0, help_text="Higher runs first; ties run first-in first-out.")
    status = models.CharField(max_length=16, choices=JobStatus.choices, default=JobStatus.QUEUED, db_index=True)

    attempt_count = models.PositiveIntegerField(default=0, help_text="Dispatches so far.")
    retry_count = models.PositiveIntegerField(default=0, help_text="Retries spent on lost or failed attempts.")
    max_retries = models.PositiveIntegerField(default=3)
    retry_on_failure = models.BooleanField(
        default=False, help_text="Also retry when the trainer itself fails (not only when its worker is lost)."
    )
    lease_id = models.CharField(max_length=40, null=True, blank=True, help_text="Current attempt's lease.")

    worker = models.ForeignKey(
        "workers.Worker", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs"
    )
    worker_name = models.CharField(max_length=128, blank=True, default="", help_text="Kept after worker deletion.")
    # The GPUs of its packing worker (``Worker.gpu_slots``) the job was placed on at its latest dispatch (kept once it
    # ended; cleared when it goes back to the queue). Null on a worker that does not pack (the whole worker).
    gpu_indices = models.JSONField(null=True, blank=True)
    # Whether it holds those GPUs now: from its dispatch until it leaves the worker (ended, requeued, its cancel
    # confirmed). A job holding them is one of its packing worker's jobs (job_queue.packing).
    holds_gpus = models.BooleanField(default=False)
    progress = models.JSONField(default=dict, blank=True)
    last_error = models.TextField(blank=True, default="")
    exit_code = models.BigIntegerField(null=True, blank=True, help_text="As the agent reported it: up to 2**32-1 (Windows)")
    log_tail = models.TextField(blank=True, default="", help_text="Last lines of the trainer's output.")

    submitted_at = models.DateTimeField(auto_now_add=True, db_index=True)
    dispatched_at = models.DateTimeField(null=True, blank=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    submitted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    team = models.ForeignKey(
        "tenancy.Team", null=True, blank=True, on_delete=models.SET_NULL, related_name="jobs",
        help_text="The team the job is charged to (tenancy); empty for none.",
    )
    # The job's fair share (job_queue.fairshare): its team's, else its submitter's; kept by the database.
    share = models.GeneratedField(
        expression=models.Case(
            models.When(team__isnull=False, then=models.F("team_id") * 2 + 1),
            default=Coalesce(models.F("submitted_by_id"), 0) * 2,
        ),
        output_field=models.BigIntegerField(),
        db_persist=True,
    )
    retry_of = models.ForeignKey(
        "self",
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="retries",
        help_text="The failed or cancelled job this one re-runs (an operator's retry).",
        db_index=False,  # indexed where set only (Meta.indexes)
    )

    class Meta:
        ordering = ["-submitted_at"]
        # Each operator action on jobs has its own permission (job_queue.permissions); reading is view_job.
        permissions = [
            ("submit_job", "Can submit a job"),
            ("cancel_job", "Can cancel a job"),
            ("retry_job", "Can retry a failed or cancelled job"),
        ]
        indexes = [
            # The queue's order (job_queue.dispatch): a dispatch reads its first row, never sorts the backlog.
            # With the last key (id) in it too: SQLite, with statistics that show most jobs queued, scanned
            # and sorted a backlog of 10,000 for each dispatch (3.7 ms) rather than sort the ties on id.
            models.Index(fields=["status", "-priority", "submitted_at", "id"], name="job_dispatch_order"),
            # Each share's queue in the same order: a freed worker reads the head of each share from it
            # (job_queue.fairshare). Status leads, not a partial index: a bound status value matches no predicate.
            models.Index(fields=["status", "share", "-priority", "submitted_at", "id"], name="job_share_order"),
            # Almost every job has no retry_of: a plain index holds one key for nearly all rows, and after
            # ANALYZE SQLite judged it useless and scanned the table for a job's retries (12 ms at 105,000 jobs).
            models.Index(fields=["retry_of"], name="job_retry_of", condition=models.Q(retry_of__isnull=False)),
            # The few queued multi-node jobs, which a freed worker's offer never takes (job_queue.gangs).
            models.Index(
                fields=["-priority", "submitted_at", "id"], name="job_gang_queued",
                condition=models.Q(status="queued", num_nodes__gt=1),
            ),
        ]

    def __str__(self):
        return f"{self.config_name} ({self.id})"

    @property
    def retries_left(self):
        return max(self.max_retries - self.retry_count, 0)


class AttemptOutcome(models.TextChoices):
    PENDING = "", "In progress"
    COMPLETED = "completed", "Completed"
    FAILED = "failed", "Failed"
    CANCELLED = "cancelled", "Cancelled"
    LOST = "lost", "Worker lost"
    UNACKNOWLEDGED = "unacknowledged", "Dispatch not acknowledged"
    INTERRUPTED = "interrupted", "Interrupted by an operator (no retry spent)"
    SUPERSEDED = "superseded", "Superseded (an earlier attempt completed)"


class JobAttempt(models.Model):
    """One dispatch of a job to a worker, fenced by its lease id."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="attempts")
    number = models.PositiveIntegerField()
    lease_id = models.CharField(max_length=40, unique=True)
    worker = models.ForeignKey("workers.Worker", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    worker_name = models.CharField(max_length=128, blank=True, default="")
    dispatched_at = models.DateTimeField()
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    outcome = models.CharField(max_length=16, choices=AttemptOutcome.choices, blank=True, default="")
    error = models.TextField(blank=True, default="")
    # The GPUs the attempt holds, charged from its acknowledgement (started_at) to its end (job_queue.usage):
    # the job's gpu_count, else (any worker) its worker's GPU count at dispatch.
    gpus = models.PositiveIntegerField(default=0)
    # The worker's GPU indices the attempt ran on (a packing worker's; null: the whole worker).
    gpu_indices = models.JSONField(null=True, blank=True)
    # How far its GPU time has been charged to its share's fair-share usage (job_queue.fairshare); null: not yet.
    charged_until = models.DateTimeField(null=True, blank=True)
    # The attempt's whole output (job_queue.logs): its last SIMPLETUNER_JOB_LOG_MAX_CHARS characters, how many
    # lines were received, how many characters were cut from its start, how many lines never arrived.
    log = models.TextField(blank=True, default="")
    log_lines = models.PositiveIntegerField(default=0)
    log_dropped_chars = models.BigIntegerField(default=0)
    log_missing_lines = models.PositiveIntegerField(default=0)
    # [seconds since dispatch, step, loss] as progress arrived (job_queue.progress_history), for the job's chart.
    progress_samples = models.JSONField(default=list, blank=True)

    class Meta:
        ordering = ["job", "number"]
        constraints = [models.UniqueConstraint(fields=["job", "number"], name="attempt_number_unique")]
        # Usage (job_queue.usage) reads the attempts that ended in a window, or still run.
        indexes = [
            models.Index(fields=["finished_at"], name="attempt_finished_at"),
            # The few attempts whose GPU time is not charged to fair share yet: running, or ended since the last charge.
            models.Index(
                fields=["started_at"],
                name="attempt_uncharged",
                condition=models.Q(started_at__isnull=False)
                & (
                    models.Q(finished_at__isnull=True)
                    | models.Q(charged_until__isnull=True)
                    | models.Q(charged_until__lt=models.F("finished_at"))
                ),
            ),
        ]

    def __str__(self):
        return f"attempt {self.number} of {self.job_id}"


class GangMember(models.Model):
    """One worker's part in one dispatch (attempt) of a multi-node job: its rank and GPUs (job_queue.gangs).

    Every member runs under the attempt's lease; reports and acknowledgements are fenced by (lease, worker)."""

    job = models.ForeignKey(Job, on_delete=models.CASCADE, related_name="members")
    lease_id = models.CharField(max_length=40)
    rank = models.PositiveIntegerField()
    worker = models.ForeignKey("workers.Worker", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    worker_name = models.CharField(max_length=128, blank=True, default="")
    # The GPUs it was given on a packing worker (its slots, allocated as a packed job's are); null on a worker that
    # does not pack (the whole worker, held as its ``current_job``).
    gpu_indices = models.JSONField(null=True, blank=True)
    # Whether it holds those GPUs now: from its dispatch until its agent says it runs the job no more (a heartbeat
    # without it, a report that it is over, a registration without it) or its worker is lost. A member holding them
    # is one of its packing worker's jobs (job_queue.packing), whatever its outcome.
    holds_gpus = models.BooleanField(default=False)
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    # "" while it runs; then completed, failed, cancelled or lost (what its worker said, or that it went silent).
    outcome = models.CharField(max_length=16, blank=True, default="")
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["job", "lease_id", "rank"]
        constraints = [models.UniqueConstraint(fields=["lease_id", "rank"], name="gang_member_rank_unique")]
        indexes = [
            models.Index(fields=["worker", "lease_id"], name="gang_member_worker"),
            models.Index(fields=["worker"], condition=models.Q(holds_gpus=True), name="gang_member_holding"),
        ]

    def __str__(self):
        return f"rank {self.rank} of {self.job_id} ({self.lease_id})"


class FairShare(models.Model):
    """A share of the fleet (a team, or a user's jobs without a team) and its decayed GPU usage (job_queue.fairshare).

    ``usage_log`` is log2 of the sum of its GPU-seconds, each weighted by 2 ** ((when - FAIRSHARE_EPOCH) / half-life):
    comparing it orders the shares by decayed usage at any instant. Null: nothing charged yet (least of all)."""

    key = models.BigIntegerField(primary_key=True)  # Job.share
    usage_log = models.FloatField(null=True, blank=True)
    updated_at = models.DateTimeField(auto_now=True)

    def __str__(self):
        return f"share {self.key}"


def labels_match(patterns, labels):
    """Return True if every ``label: glob`` in ``patterns`` matches the worker's ``labels``.

    Matching is case-sensitive shell-style globbing (``a100*``); a label the worker lacks never matches.
    """
    for key, pattern in (patterns or {}).items():
        value = (labels or {}).get(key)
        if value is None or not fnmatch.fnmatchcase(str(value), str(pattern)):
            return False
    return True


def job_fits_worker(job, worker):
    """Return True if ``worker``'s capabilities satisfy ``job`` (GPU count and labels; not availability). A multi-node
    job fits no single worker: it is placed as a gang (job_queue.gangs)."""
    return job.num_nodes <= 1 and worker.gpu_count >= job.gpu_count and labels_match(job.worker_labels, worker.labels)
