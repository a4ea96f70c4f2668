"""Every write to workers and tokens: creation, registration, liveness, drain, rotation, deletion."""

import logging
import math
from datetime import timedelta

from django.db import transaction
from django.utils import timezone

from audit import actions
from audit.services import Actor, audit_record
from simpletuner_site.errors import Conflict, InvalidInput, InvalidTransition, NotFound, StaleReport

from . import events
from .models import (
    WORKER_TRANSITIONS,
    ServerPresence,
    Token,
    TokenKind,
    Worker,
    WorkerStatus,
    WorkerType,
    generate_token,
    hash_token,
)

logger = logging.getLogger(__name__)

TOKEN_TOUCH_INTERVAL_S = 60


# --- tokens --------------------------------------------------------------------------------------


def token_issue(*, kind, worker=None, user=None, description=""):
    """Create a token and return ``(token, plaintext)``; the plaintext exists only in this return value."""
    plaintext = generate_token(kind)
    token = Token.objects.create(
        kind=kind,
        digest=hash_token(plaintext),
        prefix=plaintext[:10],
        worker=worker,
        user=user,
        description=description,
    )
    return token, plaintext


def token_authenticate(*, kind, plaintext):
    """Return the active token of ``kind`` whose secret is ``plaintext``, or None.

    Marks the token used (at most once a minute, so heartbeats do not write on every call).
    """
    if not plaintext:
        return None
    plaintext = plaintext.strip()
    qs = Token.objects.select_related("worker", "user").filter(
        kind=kind, digest=hash_token(plaintext), revoked_at__isnull=True
    )
    token = qs.first()
    if token is None:
        return None
    now = timezone.now()
    if token.last_used_at is None or (now - token.last_used_at).total_seconds() > TOKEN_TOUCH_INTERVAL_S:
        Token.objects.filter(pk=token.pk).update(last_used_at=now)
    return token


def api_token_create(*, user, actor, description=""):
    """Issue an operator API token for ``user``; return the plaintext (shown once)."""
    with transaction.atomic():
        token, plaintext = token_issue(kind=TokenKind.API, user=user, description=description)
        audit_record(
            actor=actor,
            action=actions.API_TOKEN_CREATED,
            target_type="user",
            target_id=user.pk,
            details={"username": user.get_username(), "token_prefix": token.prefix},
        )
    return plaintext


# --- the one writer of Worker.status ------------------------------------------------------------


def _lock_worker(worker_id):
    try:
        return Worker.objects.select_for_update().get(pk=worker_id)
    except Worker.DoesNotExist:
        raise NotFound(f"worker {worker_id} does not exist") from None


def worker_transition(*, worker, to, actor, reason="", **fields):
    """Move a locked ``worker`` to status ``to``, write ``fields`` with it, and audit the change.

    Raise InvalidTransition if the table in ``workers.models`` forbids it. A transition to the
    current status only writes ``fields`` (no audit row).
    """
    before = worker.status
    if before not in WORKER_TRANSITIONS[to]:
        raise InvalidTransition(f"worker {worker.pk} cannot go from {before} to {to}")
    now = timezone.now()
    if before != to:
        fields["status_changed_at"] = now
    updated = Worker.objects.filter(pk=worker.pk, status=before).update(status=to, **fields)
    if updated != 1:
        raise InvalidTransition(f"worker {worker.pk} changed status concurrently; from {before} to {to} refused")
    for name, value in fields.items():
        setattr(worker, name, value)
    worker.status = to
    if before != to:
        audit_record(
            actor=actor,
            action=actions.WORKER_STATUS_CHANGED,
            target_type="worker",
            target_id=worker.pk,
            details={"from": before, "to": to, "reason": reason},
        )
    return worker


def worker_resting_status(worker, *, busy):
    """Return the status a live worker should have: draining wins, then busy, then idle."""
    if worker.drain_requested_at is not None:
        return WorkerStatus.DRAINING
    return WorkerStatus.BUSY if busy else WorkerStatus.IDLE


# --- operator actions -----------------------------------------------------------------------------


def _clean_labels(labels):
    if labels is None:
        return {}
    if not isinstance(labels, dict):
        raise InvalidInput("labels must be an object of string values", code="invalid_labels")
    cleaned = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not key or not isinstance(value, (str, int, float, bool)):
            raise InvalidInput(f"label {key!r} must map a non-empty name to a string", code="invalid_labels")
        cleaned[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return cleaned


def worker_create(*, name, worker_type=WorkerType.PERSISTENT, labels=None, actor):
    """Create a worker and its first token; return ``(worker, plaintext_token)``."""
    name = (name or "").strip()
    if not name:
        raise InvalidInput("name is required", code="invalid_name")
    if worker_type not in WorkerType.values:
        raise InvalidInput(f"worker_type must be one of {', '.join(WorkerType.values)}", code="invalid_worker_type")
    labels = _clean_labels(labels)
    with transaction.atomic():
        if Worker.objects.filter(name=name).exists():
            raise Conflict(f"a worker named {name!r} already exists", code="name_taken")
        worker = Worker.objects.create(
            name=name, worker_type=worker_type, labels=labels, created_by_id=actor.user_id
        )
        token, plaintext = token_issue(kind=TokenKind.WORKER, worker=worker)
        audit_record(
            actor=actor,
            action=actions.WORKER_CREATED,
            target_type="worker",
            target_id=worker.pk,
            details={"name": name, "worker_type": worker_type, "labels": labels, "token_prefix": token.prefix},
        )
    return worker, plaintext


def worker_provision_local(*, name, actor, plaintext=None):
    """Return ``(worker, plaintext_token)`` for the orchestrator's built-in local worker named ``name``.

    Create the worker (type ``local``, no labels) if it does not exist. Reuse ``plaintext`` when it is
    an active token of that worker (nothing is written then); otherwise revoke the worker's tokens,
    close streams opened with them and issue a new one. Raise Conflict (``name_taken``) if a worker
    named ``name`` exists and is not of type ``local``.
    """
    name = (name or "").strip()
    if not name:
        raise InvalidInput("name is required", code="invalid_name")
    with transaction.atomic():
        worker, created = Worker.objects.get_or_create(
            name=name, defaults={"worker_type": WorkerType.LOCAL, "labels": {}}
        )
        if worker.worker_type != WorkerType.LOCAL:
            raise Conflict(
                f"a worker named {name!r} already exists and is a {worker.worker_type} worker, "
                "not the built-in local worker",
                code="name_taken",
            )
        if not created:
            worker = _lock_worker(worker.pk)
            token = token_authenticate(kind=TokenKind.WORKER, plaintext=plaintext)
            if token is not None and token.worker_id == worker.pk:
                return worker, plaintext.strip()
        old_ids = list(worker.tokens.filter(revoked_at__isnull=True).values_list("pk", flat=True))
        worker.tokens.filter(pk__in=old_ids).update(revoked_at=timezone.now())
        token, new_plaintext = token_issue(kind=TokenKind.WORKER, worker=worker, description="built-in local worker")
        audit_record(
            actor=actor,
            action=actions.LOCAL_WORKER_PROVISIONED,
            target_type="worker",
            target_id=worker.pk,
            details={
                "name": name,
                "created": created,
                "revoked_tokens": len(old_ids),
                "token_prefix": token.prefix,
            },
        )
        if old_ids:
            events.revoke_streams_on_commit(worker.pk, old_ids, "local worker token re-issued")
    return worker, new_plaintext


def worker_rotate_token(*, worker_id, actor):
    """Revoke every token of the worker, issue a new one, close streams opened with the old; return plaintext."""
    with transaction.atomic():
        worker = _lock_worker(worker_id)
        old_ids = list(worker.tokens.filter(revoked_at__isnull=True).values_list("pk", flat=True))
        worker.tokens.filter(pk__in=old_ids).update(revoked_at=timezone.now())
        token, plaintext = token_issue(kind=TokenKind.WORKER, worker=worker)
        audit_record(
            actor=actor,
            action=actions.WORKER_TOKEN_ROTATED,
            target_type="worker",
            target_id=worker.pk,
            details={"revoked_tokens": len(old_ids), "token_prefix": token.prefix},
        )
        events.revoke_streams_on_commit(worker.pk, old_ids, "token rotated")
    return plaintext


def worker_delete_refusal(worker):
    """Return why ``worker`` may not be deleted now, or None if it may (offline, or never connected)."""
    if worker.status == WorkerStatus.OFFLINE or (worker.status == WorkerStatus.CONNECTING and worker.never_connected):
        return None
    return (
        f"worker {worker.name} is {worker.status}; only an offline worker can be deleted "
        "(drain it and stop its agent first)"
    )


def worker_delete(*, worker_id, actor):
    """Delete an offline (or never connected) worker, keeping its jobs and audit trail.

    Raise Conflict if the worker is online.
    """
    with transaction.atomic():
        worker = _lock_worker(worker_id)
        refusal = worker_delete_refusal(worker)
        if refusal:
            raise Conflict(refusal, code="worker_online")
        token_ids = list(worker.tokens.values_list("pk", flat=True))
        audit_record(
            actor=actor,
            action=actions.WORKER_DELETED,
            target_type="worker",
            target_id=worker.pk,
            details={"name": worker.name, "worker_type": worker.worker_type, "labels": worker.labels},
        )
        worker.delete()
        events.revoke_streams_on_commit(worker_id, token_ids, "worker deleted")


def worker_drain(*, worker_id, actor):
    """Stop new dispatch to the worker; it finishes its current job. Idempotent.

    The drain is durable: heartbeats and re-registration keep it, and an offline worker comes back draining.
    """
    with transaction.atomic():
        worker = _lock_worker(worker_id)
        if worker.drain_requested_at is None:
            now = timezone.now()
            Worker.objects.filter(pk=worker.pk).update(drain_requested_at=now)
            worker.drain_requested_at = now
            audit_record(
                actor=actor,
                action=actions.WORKER_DRAIN_REQUESTED,
                target_type="worker",
                target_id=worker.pk,
                details={"status": worker.status, "current_job": worker.current_job_id},
            )
        if worker.status != WorkerStatus.OFFLINE:
            worker_transition(worker=worker, to=WorkerStatus.DRAINING, actor=actor, reason="drain requested")
        events.publish_on_commit(worker.pk, events.DRAIN, current_job_id=worker.current_job_id)
    return worker


# --- the agent's side of the protocol -----------------------------------------------------------


def _number(value, *, field, integer=False, minimum=0):
    if value is None or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise InvalidInput(f"{field} must be a number", code="invalid_capabilities") from None
    if not math.isfinite(number) or number < minimum:
        raise InvalidInput(f"{field} must be a finite number >= {minimum}", code="invalid_capabilities")
    return int(number) if integer else number


def parse_capabilities(data):
    """Return Worker fields from a register body, accepting the spec's flat fields and upstream ``gpu_info``."""
    gpu_info = data.get("gpu_info")
    if gpu_info is not None and not isinstance(gpu_info, dict):
        raise InvalidInput("gpu_info must be an object", code="invalid_capabilities")
    gpu_info = gpu_info or {}

    def pick(flat, nested):
        value = data.get(flat)
        return gpu_info.get(nested) if value is None else value

    count = _number(pick("gpu_count", "count"), field="gpu_count", integer=True)
    vram = _number(pick("gpu_vram_gb", "vram_gb"), field="gpu_vram_gb")
    name = pick("gpu_name", "name")
    accelerator = pick("accelerator_type", "accelerator")
    raw = dict(gpu_info)
    for key in ("gpu_count", "gpu_name", "gpu_vram_gb", "accelerator_type", "gpus", "driver_version", "cuda_version"):
        if data.get(key) is not None:
            raw[key] = data[key]
    return {
        "gpu_count": count or 0,
        "gpu_name": str(name or "")[:200],
        "gpu_vram_gb": vram,
        "accelerator_type": str(accelerator or ("cuda" if count else "cpu"))[:32],
        "gpu_info": raw,
        "hostname": str(data.get("hostname") or "")[:255],
        "agent_version": str(data.get("agent_version") or data.get("version") or "")[:64],
    }


def worker_register_failed(*, reason, token_prefix, ip, name=""):
    """Audit a refused registration (bad or revoked token)."""
    with transaction.atomic():
        audit_record(
            actor=Actor("worker", "", str(name or "")[:150], ip),
            action=actions.WORKER_REGISTRATION_FAILED,
            target_type="worker",
            details={"reason": reason, "token_prefix": token_prefix},
            success=False,
        )


def worker_register(*, worker_id, data, actor):
    """Record a (re)connecting agent's capabilities and reconcile the job it says it is running.

    Return the register response: ``worker_id``, ``status`` and, when the agent reported a job,
    ``resume_job`` (still its own and active) or ``abandon_job`` (anything else).
    """
    from job_queue import services as job_services

    caps = parse_capabilities(data)
    reported_job_id = data.get("current_job_id") or None
    now = timezone.now()
    with transaction.atomic():
        worker = _lock_worker(worker_id)
        assigned = job_services.lock_job(worker.current_job_id) if worker.current_job_id else None
        response = {"worker_id": worker.pk}
        resume = None
        if reported_job_id:
            reported_job_id = str(reported_job_id)
            if assigned is not None and assigned.pk == reported_job_id and job_services.job_is_live(assigned):
                resume = assigned
                response["resume_job"] = job_services.job_resume_payload(assigned)
            else:
                response["abandon_job"] = reported_job_id
        if assigned is not None and resume is None:
            # The agent came back without the job we gave it: that attempt is over.
            job_services.job_release_from_worker(
                job=assigned, worker=worker, actor=actor, reason="worker re-registered without its job"
            )
        worker_transition(
            worker=worker,
            to=worker_resting_status(worker, busy=resume is not None),
            actor=actor,
            reason="registered",
            last_heartbeat=now,
            connected_at=now,
            current_job=resume,
            **caps,
        )
        audit_record(
            actor=actor,
            action=actions.WORKER_REGISTERED,
            target_type="worker",
            target_id=worker.pk,
            details={
                "gpu_count": caps["gpu_count"],
                "gpu_name": caps["gpu_name"],
                "accelerator_type": caps["accelerator_type"],
                "reported_job": reported_job_id,
                "resumed": resume is not None,
                "agent_persistent": data.get("persistent"),
            },
        )
        if worker.status == WorkerStatus.IDLE:
            job_services.dispatch_on_commit(worker_id=worker.pk)
    response["status"] = worker.status
    response["worker_type"] = worker.worker_type
    response["draining"] = worker.drain_requested_at is not None
    return response


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


def worker_heartbeat(*, worker_id, data, actor):
    """Record liveness (and utilisation/progress if sent); return the worker's view of its state.

    Raise StaleReport if the agent names a job that is no longer its own; only that refusal's audit
    row is written then. A heartbeat never takes a worker out of draining; an offline worker that
    heartbeats comes back.
    """
    reported_job_id = data.get("current_job_id") or None
    now = timezone.now()
    with transaction.atomic():
        worker = _lock_worker(worker_id)
        refused = bool(reported_job_id) and str(reported_job_id) != worker.current_job_id
        if refused:
            # Audited and committed before raising: this refusal is what makes a returning agent stop its copy.
            audit_record(
                actor=actor,
                action=actions.JOB_REPORT_REFUSED,
                target_type="job",
                target_id=str(reported_job_id),
                details={"reported": "heartbeat", "reason": "job_not_owned", "worker": worker.pk},
                success=False,
            )
        else:
            _record_heartbeat(worker=worker, data=data, reported_job_id=reported_job_id, now=now, actor=actor)
    if refused:
        raise StaleReport(
            f"job {reported_job_id} is not assigned to worker {worker.name}; stop it",
            code="job_not_owned",
            extra={"abandon_job": str(reported_job_id)},
        )
    return {
        "status": worker.status,
        "draining": worker.drain_requested_at is not None,
        "current_job_id": worker.current_job_id,
    }


def _record_heartbeat(*, worker, data, reported_job_id, now, actor):
    """Write a heartbeat of the locked ``worker``: liveness, metrics, progress, and any state it implies."""
    from job_queue import services as job_services

    metrics = {k: data[k] for k in HEARTBEAT_METRIC_FIELDS if k in data}
    fields = {"last_heartbeat": now}
    if metrics:
        fields["metrics"] = metrics
    if worker.status == WorkerStatus.OFFLINE:
        worker_transition(
            worker=worker,
            to=worker_resting_status(worker, busy=worker.current_job_id is not None),
            actor=actor,
            reason="heartbeat after being offline",
            **fields,
        )
        if worker.status == WorkerStatus.IDLE:
            job_services.dispatch_on_commit(worker_id=worker.pk)
    else:
        Worker.objects.filter(pk=worker.pk).update(**fields)
    if reported_job_id and data.get("progress") is not None:
        job_services.job_record_progress(job_id=worker.current_job_id, worker=worker, data=data)
    elif not reported_job_id and worker.current_job_id:
        # The agent runs nothing: a cancelled job it held is over, so the worker is free again.
        job_services.job_reconcile_idle_agent(worker=worker, actor=actor)


def worker_disconnect(*, worker_id, actor, reason="agent disconnected"):
    """Take the worker offline; a job it held goes back to the queue by the retry rules.

    A worker that never registered stays ``connecting``: there is no session to end.
    """
    from job_queue import services as job_services

    with transaction.atomic():
        worker = _lock_worker(worker_id)
        if worker.current_job_id:
            job = job_services.lock_job(worker.current_job_id)
            if job is not None:
                job_services.job_release_from_worker(job=job, worker=worker, actor=actor, reason=reason)
        if worker.status not in (WorkerStatus.OFFLINE, WorkerStatus.CONNECTING):
            worker_transition(worker=worker, to=WorkerStatus.OFFLINE, actor=actor, reason=reason, current_job=None)
        elif worker.current_job_id:
            Worker.objects.filter(pk=worker.pk).update(current_job=None)
        audit_record(
            actor=actor,
            action=actions.WORKER_DISCONNECTED,
            target_type="worker",
            target_id=worker.pk,
            details={"reason": reason, "worker_type": worker.worker_type},
        )
    return {"status": worker.status}


def worker_stream_opened(*, worker_id, stream_id, replaying):
    """Mark the worker's stream open; hand it work: re-send an unacknowledged dispatch, or dispatch anew.

    ``replaying`` is True when the agent resumes with Last-Event-ID (the library replays what it missed).
    """
    from job_queue import services as job_services

    with transaction.atomic():
        worker = _lock_worker(worker_id)
        Worker.objects.filter(pk=worker.pk).update(stream_id=stream_id, stream_opened_at=timezone.now())
        if worker.current_job_id and not replaying:
            job_services.job_redeliver_on_commit(job_id=worker.current_job_id, worker_id=worker.pk)
        if worker.status == WorkerStatus.IDLE:
            job_services.dispatch_on_commit(worker_id=worker.pk)


def worker_stream_closed(*, worker_id, stream_id):
    """Forget the stream ``stream_id`` if it is still the worker's current one."""
    Worker.objects.filter(pk=worker_id, stream_id=stream_id).update(stream_id=None)


def heartbeat_interval():
    """Return the heartbeat period (seconds) agents are asked to keep."""
    from django.conf import settings

    return settings.SIMPLETUNER["HEARTBEAT_INTERVAL"]


def worker_stream_refused(*, reason, token_prefix, ip):
    """Audit a refused stream connection."""
    with transaction.atomic():
        audit_record(
            actor=Actor("worker", "", "", ip),
            action=actions.WORKER_STREAM_REFUSED,
            target_type="worker",
            details={"reason": reason, "token_prefix": token_prefix},
            success=False,
        )


# --- server presence (who was up to hear heartbeats) ---------------------------------------------

PRESENCE_KEEP = timedelta(days=7)


def presence_interval():
    """Return how often (seconds) a server writes its presence: at most every 10 s, and at least as
    often as agents heartbeat, so a dead server is noticed before a worker's silence counts."""
    from django.conf import settings

    return min(10.0, float(settings.SIMPLETUNER["HEARTBEAT_INTERVAL"]))


def server_presence_beat(*, process_id, hostname, pid, started_at, now=None):
    """Record that server process ``process_id`` is up now; forget processes silent for a week."""
    now = now or timezone.now()
    updated = ServerPresence.objects.filter(pk=process_id).update(last_seen=now)
    if not updated:
        ServerPresence.objects.create(
            pk=process_id, hostname=hostname[:255], pid=pid, started_at=started_at, last_seen=now
        )
        ServerPresence.objects.filter(last_seen__lt=now - PRESENCE_KEEP).delete()
