"""Workers (GPU machines) and the bearer tokens that authenticate workers and operators."""

import hashlib
import secrets

from django.conf import settings
from django.db import models

from worker_agent import protocol


def new_worker_id():
    return "w_" + secrets.token_hex(6)


class WorkerType(models.TextChoices):
    EPHEMERAL = protocol.WORKER_EPHEMERAL, "Ephemeral"
    PERSISTENT = protocol.WORKER_PERSISTENT, "Persistent"
    LOCAL = protocol.WORKER_LOCAL, "Local (built into the orchestrator)"


class WorkerStatus(models.TextChoices):
    CONNECTING = "connecting", "Connecting"
    IDLE = "idle", "Idle"
    BUSY = "busy", "Busy"
    DRAINING = "draining", "Draining"
    OFFLINE = "offline", "Offline"


# Statuses in which the agent is known to be alive and holding a session with us.
WORKER_ONLINE = frozenset({WorkerStatus.IDLE, WorkerStatus.BUSY, WorkerStatus.DRAINING})

# Allowed transitions: target -> statuses it may be entered from. Self-transitions are not listed;
# services treat "already there" explicitly where it is legal (e.g. re-registration of an idle worker).
WORKER_TRANSITIONS = {
    # From draining only when an operator puts the worker back in service (undrain).
    WorkerStatus.IDLE: frozenset(
        {WorkerStatus.CONNECTING, WorkerStatus.OFFLINE, WorkerStatus.BUSY, WorkerStatus.IDLE, WorkerStatus.DRAINING}
    ),
    WorkerStatus.BUSY: frozenset(
        {WorkerStatus.CONNECTING, WorkerStatus.OFFLINE, WorkerStatus.IDLE, WorkerStatus.BUSY, WorkerStatus.DRAINING}
    ),
    WorkerStatus.DRAINING: frozenset(
        {WorkerStatus.CONNECTING, WorkerStatus.OFFLINE, WorkerStatus.IDLE, WorkerStatus.BUSY, WorkerStatus.DRAINING}
    ),
    WorkerStatus.OFFLINE: frozenset({WorkerStatus.IDLE, WorkerStatus.BUSY, WorkerStatus.DRAINING}),
    WorkerStatus.CONNECTING: frozenset(),
}


# ``Worker.offer_rank`` of a local worker that never finished a job; remote workers rank below it, and a
# worker that finished one ranks one above its never-finished peers.
OFFER_RANK_LOCAL = 2


class Worker(models.Model):
    id = models.CharField(primary_key=True, max_length=32, default=new_worker_id, editable=False)
    name = models.CharField(max_length=128, unique=True)
    worker_type = models.CharField(max_length=16, choices=WorkerType.choices, default=WorkerType.PERSISTENT)
    status = models.CharField(
        max_length=16, choices=WorkerStatus.choices, default=WorkerStatus.CONNECTING, db_index=True
    )
    labels = models.JSONField(default=dict, blank=True)

    gpu_count = models.PositiveIntegerField(default=0)
    gpu_name = models.CharField(max_length=200, blank=True, default="")
    gpu_vram_gb = models.FloatField(null=True, blank=True)
    accelerator_type = models.CharField(max_length=32, blank=True, default="")
    gpu_info = models.JSONField(default=dict, blank=True, help_text="Capabilities exactly as the agent reported them.")
    hostname = models.CharField(max_length=255, blank=True, default="")
    agent_version = models.CharField(max_length=64, blank=True, default="")
    # What the agent says of itself at registration (its --name and --persistent), shown beside the worker's own.
    agent_name = models.CharField(max_length=128, blank=True, default="")
    agent_persistent = models.BooleanField(null=True, blank=True)
    metrics = models.JSONField(default=dict, blank=True, help_text="Utilisation from the latest heartbeat.")
    # Packing (several jobs at once, each on its own GPUs; job_queue.packing): the jobs the worker is sent at once,
    # as its agent asked at registration (``protocol.RegisterRequest.max_jobs``; 1, SimpleTuner's released agent and
    # any agent that does not say: one job at a time, held as ``current_job``). With more than 1 its jobs are the
    # jobs placed on it (``Job.holds_gpus``) and ``current_job`` stays empty.
    max_jobs = models.PositiveIntegerField(default=1)
    # The GPU indices a packing worker's jobs are given (its agent's ``gpu_slots``), and whether no NVIDIA GPU backs
    # them (declared on a CPU node, or in tests).
    gpu_slots = models.JSONField(default=list, blank=True)
    gpu_slots_declared = models.BooleanField(default=False)
    # The GPUs a new job may take on a packing worker now: its slots no job or gang member holds (job_queue.packing),
    # 0 while it holds max_jobs of them or a job that takes the whole worker. Kept in each transaction that places a job on it or takes one off;
    # always 0 on a worker that does not pack. A dispatch reads it from the index worker_packing_offer.
    gpus_free = models.PositiveIntegerField(default=0)

    # The job the worker runs (a worker that does not pack). A member of a multi-node job (job_queue.gangs) holds that
    # job too, as ``gang_rank`` (0 for any other job): no two workers ever hold one job under the same rank. A
    # packing worker's members are held by their GangMember rows (``holds_gpus``), not here.
    current_job = models.ForeignKey(
        "queue.Job", null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    gang_rank = models.PositiveIntegerField(default=0)
    # Multi-node jobs (job_queue.gangs): whether the agent said it runs a member of one (``protocol.RegisterRequest
    # .multi_node``: ours; never SimpleTuner's released agent), the address other members reach it at (its
    # ``advertise_address``), and the address the orchestrator saw it register from (the fallback).
    multi_node = models.BooleanField(default=False)
    advertise_address = models.CharField(max_length=255, blank=True, default="")
    registered_address = models.CharField(max_length=64, blank=True, default="")
    drain_requested_at = models.DateTimeField(null=True, blank=True)
    # The SSE stream currently serving this worker (any process): the newest of ``open_streams``;
    # null when none is open.
    stream_id = models.CharField(max_length=40, null=True, blank=True)
    # Every stream open for this worker, oldest first: [{"id": stream id, "process": server process id}].
    # A second stream (a curl beside the agent) never hides the first: when one closes, the newest left serves.
    open_streams = models.JSONField(default=list, blank=True)
    # The instance (protocol.AGENT_INSTANCE_HEADER) of the agent that registered last ("" for one that sends none),
    # and the instances another agent took this worker over from, newest last (at most
    # job_queue.agents.REPLACED_KEPT): such an agent that comes back (its link was cut meanwhile) is refused.
    agent_instance = models.CharField(max_length=64, blank=True, default="")
    replaced_instances = models.JSONField(default=list, blank=True)
    stream_opened_at = models.DateTimeField(null=True, blank=True)

    last_heartbeat = models.DateTimeField(null=True, blank=True, db_index=True)
    connected_at = models.DateTimeField(null=True, blank=True)
    last_job_finished_at = models.DateTimeField(null=True, blank=True)
    # Where the worker stands in the order a job is offered to idle workers (``job_queue.dispatch``):
    # remote before local, and within each, workers that never finished a job before those that did.
    # Kept by the database, so the offer order is an index scan (``worker_offer_order``); with the
    # never-finished apart, ``last_job_finished_at`` orders only non-null values, which SQLite and
    # PostgreSQL sort alike.
    offer_rank = models.GeneratedField(
        expression=models.Case(
            models.When(worker_type=WorkerType.LOCAL, then=models.Value(OFFER_RANK_LOCAL)), default=models.Value(0)
        )
        + models.Case(models.When(last_job_finished_at__isnull=True, then=models.Value(0)), default=models.Value(1)),
        output_field=models.IntegerField(),
        db_persist=True,
    )
    status_changed_at = models.DateTimeField(auto_now_add=True)
    created_at = models.DateTimeField(auto_now_add=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )

    class Meta:
        ordering = ["name"]
        # Each operator action on workers has its own permission (workers.permissions): creating is
        # add_worker, deleting delete_worker, reading view_worker (Django's own); these are the rest.
        permissions = [
            ("drain_worker", "Can drain a worker (it finishes its job and takes no new one)"),
            ("rotate_worker_token", "Can rotate a worker's token"),
        ]
        indexes = [
            models.Index(fields=["status", "last_heartbeat"], name="worker_status_hb"),
            # The offer order of available workers (idle, no job): a dispatch reads its first row (LIMIT 1)
            # at any fleet size. The two leading columns are held constant by the query; it orders by them
            # too, so the order matches the index whether or not the plan knows the status (a generic plan).
            models.Index(
                fields=["status", "current_job", "offer_rank", "last_job_finished_at", "id"], name="worker_offer_order"
            ),
            # Busy packing workers with room, fullest first (best fit): a job no idle worker takes reads the first
            # row here. Every other busy worker has gpus_free 0, below any job's need.
            models.Index(fields=["status", "gpus_free", "id"], name="worker_packing_offer"),
        ]
        constraints = [
            # A job is held by one worker, or by each member of its gang under its own rank (job_queue.gangs).
            models.UniqueConstraint(fields=["current_job", "gang_rank"], name="worker_job_rank_unique"),
        ]

    def __str__(self):
        return f"{self.name} ({self.id})"

    @property
    def packs(self):
        """Whether the worker runs several jobs at once, each on its own GPUs (its agent registered with max_jobs > 1)."""
        return self.max_jobs > 1

    @property
    def is_draining(self):
        return self.drain_requested_at is not None

    @property
    def has_stream(self):
        return self.stream_id is not None

    @property
    def never_connected(self):
        return self.connected_at is None

    def agent_notes(self):
        """Return where the agent's own word (its --name, --persistent) differs from the worker, one sentence each."""
        notes = []
        if self.agent_name and self.agent_name != self.name:
            notes.append(f"its agent calls itself {self.agent_name!r} (--name); it is registered as {self.name!r}")
        persistent = self.worker_type in (WorkerType.PERSISTENT, WorkerType.LOCAL)
        if self.agent_persistent is not None and self.agent_persistent != persistent:
            said = "persistent (--persistent)" if self.agent_persistent else "ephemeral (no --persistent)"
            follows = "stays online between jobs" if persistent else "exits after one job"
            notes.append(f"its agent was started {said}; it follows the worker's type, {self.worker_type}, and {follows}")
        return notes


class TokenKind(models.TextChoices):
    WORKER = "worker", "Worker"
    API = "api", "Operator API"


TOKEN_PREFIXES = {TokenKind.WORKER: "wt_", TokenKind.API: "sta_"}
# How much of a token is ever shown or recorded (``Token.prefix``): its kind's prefix and a few characters.
TOKEN_DISPLAY_LENGTH = 10


def hash_token(plaintext):
    """Return the SHA-256 hex digest under which a token is stored."""
    return hashlib.sha256(plaintext.encode("utf-8")).hexdigest()


def token_display_prefix(plaintext):
    """Return the part of ``plaintext`` that may be shown and recorded (anything not a token character as ``?``)."""
    head = (plaintext or "").strip()[:TOKEN_DISPLAY_LENGTH]
    return "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "?" for c in head)


def generate_token(kind):
    """Return a new random plaintext token for ``kind`` (e.g. ``wt_...`` for workers)."""
    return TOKEN_PREFIXES[kind] + secrets.token_urlsafe(32)


class Token(models.Model):
    """A bearer secret. Only its SHA-256 digest is stored; the plaintext is shown once at creation."""

    kind = models.CharField(max_length=8, choices=TokenKind.choices)
    digest = models.CharField(max_length=64, unique=True)
    prefix = models.CharField(max_length=16, help_text="First characters, for recognising a token in lists.")
    worker = models.ForeignKey(Worker, null=True, blank=True, on_delete=models.CASCADE, related_name="tokens")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="api_tokens"
    )
    description = models.CharField(max_length=200, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True, help_text="Refused from this moment on; never if empty.")

    class Meta:
        permissions = [("manage_api_tokens", "Can manage operators' API tokens (revoke them)")]
        constraints = [
            models.CheckConstraint(
                name="token_owner_matches_kind",
                condition=(
                    models.Q(kind="worker", worker__isnull=False, user__isnull=True)
                    | models.Q(kind="api", user__isnull=False, worker__isnull=True)
                ),
            )
        ]

    def __str__(self):
        return f"{self.prefix}… ({self.kind})"

    @property
    def is_active(self):
        return self.revoked_at is None

    def state(self, now):
        """Return ``revoked``, ``expired`` or ``active`` at ``now``."""
        if self.revoked_at is not None:
            return "revoked"
        return "expired" if self.expires_at is not None and self.expires_at <= now else "active"


class ServerPresence(models.Model):
    """A ``simpletuner server`` process's sign of life, written every few seconds while it serves.

    The heartbeat sweep trusts a worker's silence only while some server was up to hear it: when no
    server is alive (an outage, a restart) Celery beat, which runs apart from the servers, must not
    take healthy workers offline.
    """

    id = models.CharField(primary_key=True, max_length=120)  # "<host>:<pid>:<random>"
    hostname = models.CharField(max_length=255)
    pid = models.IntegerField()
    started_at = models.DateTimeField()
    last_seen = models.DateTimeField(db_index=True)

    def __str__(self):
        return self.id
