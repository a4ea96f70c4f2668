"""Writes to workers and tokens that are the workers' own: tokens, creation, drain, rotation, deletion, streams
(server presence is ``workers.presence``).

What an agent does that touches its job too (register, heartbeat, disconnect) is ``job_queue.agents``.
"""

import logging
import math
from datetime import timedelta

from django.db import transaction
from django.db.models import BooleanField, Count, ExpressionWrapper, Q
from django.utils import timezone

from audit import actions
from audit.models import ActorType
from audit.services import Actor, audit_events, audit_record, audit_write, audited_atomic
from common.errors import Conflict, InvalidInput, NotFound
from common.inputs import clean_labels, clean_text, name_problem
from common.prepared import PreparedQuery, PreparedSQL

from worker_agent import protocol

from . import events
from .models import (
    Token,
    TokenKind,
    Worker,
    WorkerStatus,
    WorkerType,
    generate_token,
    hash_token,
    token_display_prefix,
)
from .selectors import held_jobs
from .streams import live_server_processes, newest_stream_id, server_process_id, streams_with, streams_without
from .presence import presence_interval
from .transitions import workers_transition

logger = logging.getLogger(__name__)

TOKEN_TOUCH_INTERVAL_S = 60


# --- tokens --------------------------------------------------------------------------------------


def token_issue(*, kind, worker=None, user=None, description="", expires_at=None):
    """Create a token and return ``(token, plaintext)``; the plaintext exists only in this return value."""
    plaintext = generate_token(kind)
    token = Token.objects.create(
        kind=kind,
        digest=hash_token(plaintext),
        prefix=token_display_prefix(plaintext),
        worker=worker,
        user=user,
        description=description,
        expires_at=expires_at,
    )
    return token, plaintext


def _active_tokens(*, kind, plaintext=None, now, digest=None):
    """The token of ``kind`` whose secret is ``plaintext`` (or whose hash is ``digest``), if it is active at
    ``now``: not revoked, not expired.

    The one definition of a valid token: ``token_authenticate`` reads it (``_AUTHENTICATE``), and the heartbeat's
    statement embeds it compiled (``worker_token_sql``).
    """
    digest = hash_token(plaintext.strip()) if digest is None else digest
    return Token.objects.filter(kind=kind, digest=digest, revoked_at__isnull=True).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=now)
    )


def _touch_due(touched_before):
    """Whether a token is due to be marked used: never, or not since ``touched_before`` (``_touched_before``)."""
    return Q(last_used_at__isnull=True) | Q(last_used_at__lt=touched_before)


def _touched_before(now):
    """A token last used before this, ``TOKEN_TOUCH_INTERVAL_S`` before ``now``, is due to be marked used again."""
    return now - timedelta(seconds=TOKEN_TOUCH_INTERVAL_S)


# The one owner a token of each kind has (a constraint on Token): the one its authentication joins.
_OWNER = {TokenKind.WORKER: "worker", TokenKind.API: "user"}

# At most one row (the digest is unique): no ORDER BY. Run on every authenticated request, so compiled once
# per kind.
_AUTHENTICATE = PreparedQuery(
    lambda kind, *, digest, now, touched_before: _active_tokens(kind=kind, digest=digest, now=now)
    .select_related(_OWNER[kind])
    .annotate(touch_due=ExpressionWrapper(_touch_due(touched_before), output_field=BooleanField()))[:1]
)


def token_authenticate(*, kind, plaintext):
    """Return the active token of ``kind`` whose secret is ``plaintext``, or None (revoked, or expired).

    Marks the token used (at most once a minute, so heartbeats do not write on every call).
    """
    if not plaintext:
        return None
    now = timezone.now()
    token = _AUTHENTICATE.first(kind, digest=hash_token(plaintext.strip()), now=now, touched_before=_touched_before(now))
    if token is None:
        return None
    if token.touch_due:
        token_touch(plaintexts=[plaintext], now=now)
    return token


def token_active(*, kind, digest, now=None):
    """Return the token of ``kind`` whose hash is ``digest`` (with its user) if it is still active (``_active_tokens``),
    else None; it is not marked used. For what a token opened earlier (an operator's change feed) and re-checks."""
    return _active_tokens(kind=kind, digest=digest, now=now or timezone.now()).select_related("user").first()


# The same two rules as subqueries of a statement of the caller's own (the heartbeat's one UPDATE): compiled by
# the ORM once, so the rule stays ``_active_tokens``'s and ``_touch_due``'s. Compiling them on every call cost
# ~380 µs, five times the heartbeat's whole lean path.
_TOKEN_WORKER = PreparedSQL(
    lambda *, digest, now: _active_tokens(kind=TokenKind.WORKER, digest=digest, now=now).values(_OWNER[TokenKind.WORKER])[:1]
)
_TOKEN_TOUCH_DUE = PreparedSQL(
    lambda *, digest, touched_before: Token.objects.filter(digest=digest).values(
        due=ExpressionWrapper(_touch_due(touched_before), output_field=BooleanField())
    )[:1]
)


def worker_token_sql(*, plaintext, now):
    """Return ``(worker sql, params, touch-due sql, params)``: two scalar subqueries for a statement about the
    caller of a worker token, the worker whose active token is ``plaintext`` (NULL if none), and whether that
    token is due to be marked used (then ``token_touch``); ``_active_tokens`` and ``_touch_due`` compiled."""
    digest = hash_token(plaintext.strip())
    worker, worker_params = _TOKEN_WORKER.sql(digest=digest, now=now)
    due, due_params = _TOKEN_TOUCH_DUE.sql(digest=digest, touched_before=_touched_before(now))
    return f"({worker})", worker_params, f"({due})", due_params


def token_touch(*, plaintexts, now):
    """Mark the tokens whose secrets are ``plaintexts`` used at ``now`` (what ``token_authenticate`` does once a
    minute), in one statement."""
    Token.objects.filter(digest__in=[hash_token(plaintext.strip()) for plaintext in plaintexts]).update(last_used_at=now)


def api_token_create(*, user, actor, description="", expires_at=None):
    """Issue an operator API token for ``user`` (refused from ``expires_at`` on, if given); return the
    plaintext (shown once). Raise InvalidInput for an expiry not in the future or an inactive user."""
    if expires_at is not None and expires_at <= timezone.now():
        raise InvalidInput("the expiry must be in the future", code="invalid_expiry")
    if not user.is_active:
        raise InvalidInput(f"user {user.get_username()} is inactive", code="inactive_user")
    with audited_atomic():
        token, plaintext = token_issue(kind=TokenKind.API, user=user, description=description, expires_at=expires_at)
        audit_record(
            actor=actor,
            action=actions.API_TOKEN_CREATED,
            target_type="user",
            target_id=user.pk,
            details={
                "username": user.get_username(),
                "token_prefix": token.prefix,
                "expires_at": expires_at.isoformat() if expires_at else None,
            },
        )
    return plaintext


def api_tokens_revoke(*, token_ids, actor):
    """Revoke the active operator API tokens among ``token_ids``; return those revoked (one audit row each)."""
    with audited_atomic():
        tokens = list(
            Token.objects.select_for_update()
            .filter(pk__in=token_ids, kind=TokenKind.API, revoked_at__isnull=True)
            .order_by("pk")
        )
        Token.objects.filter(pk__in=[t.pk for t in tokens]).update(revoked_at=timezone.now())
        usernames = dict(
            Token.objects.filter(pk__in=[t.pk for t in tokens]).values_list("pk", "user__username")
        )
        audit_write(
            audit_events(
                actor=actor,
                action=actions.API_TOKEN_REVOKED,
                target_type="user",
                rows=[(t.user_id, {"username": usernames[t.pk], "token_prefix": t.prefix}) for t in tokens],
            )
        )
    return tokens


# --- workers ---------------------------------------------------------------------------------------


# At most one row (by primary key): no ORDER BY. Every heartbeat, report and stream of a worker takes this
# lock, so it is compiled once.
_LOCK_WORKER = PreparedQuery(lambda *, pk: Worker.objects.select_for_update().filter(pk=pk)[:1])


def lock_worker(worker_id):
    """Return the worker row locked for update; raise NotFound if there is none."""
    worker = _LOCK_WORKER.first(pk=str(worker_id))  # str(), as the ORM makes a CharField's lookup value
    if worker is None:
        raise NotFound(f"worker {worker_id} does not exist")
    return worker


def lock_workers(worker_ids):
    """Return ``{id: worker}`` of those of ``worker_ids`` that exist, locked for update in id order: the order
    every worker-side service locks in, so two of them never deadlock."""
    ids = sorted({str(worker_id) for worker_id in worker_ids})
    if len(ids) == 1:
        return {worker.pk: worker for worker in _LOCK_WORKER.run(pk=ids[0])}
    return {worker.pk: worker for worker in Worker.objects.select_for_update().filter(pk__in=ids).order_by("pk")}


# --- operator actions -----------------------------------------------------------------------------


def clean_worker_labels(labels):
    """Return a worker's labels by the label rules; raise InvalidInput (``invalid_labels``)."""
    try:
        return clean_labels(labels)
    except ValueError as exc:
        raise InvalidInput(f"labels: {exc}", code="invalid_labels") from None


def _clean_name(name):
    name = (name or "").strip()
    if not name:
        raise InvalidInput("name is required", code="invalid_name")
    most = Worker._meta.get_field("name").max_length
    problem = name_problem(name) or (f"is {len(name)} characters; at most {most}" if len(name) > most else None)
    if problem:
        raise InvalidInput(f"name {problem}", code="invalid_name")
    return name


def worker_create(*, name, worker_type=WorkerType.PERSISTENT, labels=None, actor):
    """Create a worker and its first token; return ``(worker, plaintext_token)``."""
    name = _clean_name(name)
    if worker_type not in WorkerType.values:
        raise InvalidInput(f"worker_type must be one of {', '.join(WorkerType.values)}", code="invalid_worker_type")
    labels = clean_worker_labels(labels)
    with audited_atomic():
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
    name = _clean_name(name)
    with audited_atomic():
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
            worker = lock_worker(worker.pk)
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
    with audited_atomic():
        worker = lock_worker(worker_id)
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


def worker_agent_gone(worker):
    """Whether no agent can be serving ``worker``: its token was rotated (revoked) and none of its active
    tokens has been used since (the old agent's calls are refused and the streams it opened are being closed;
    a new agent registers, which marks its token used, before it opens a stream)."""
    tokens = worker.tokens.aggregate(
        revoked=Count("pk", filter=Q(revoked_at__isnull=False)),
        in_use=Count("pk", filter=Q(revoked_at__isnull=True, last_used_at__isnull=False)),
    )
    return tokens["revoked"] > 0 and tokens["in_use"] == 0


def worker_delete_refusal(worker, *, now=None):
    """Return why ``worker`` may not be deleted now, or None if it may: offline, never connected, or
    without a job and with its agent known gone (``worker_agent_gone``: its token rotated). A refusal of
    a worker whose stream is closed says when the health sweep will take it offline."""
    if worker.status == WorkerStatus.OFFLINE or (worker.status == WorkerStatus.CONNECTING and worker.never_connected):
        return None
    holds_jobs = worker.current_job_id is not None or (worker.packs and bool(held_jobs(worker)))
    if not holds_jobs and worker_agent_gone(worker):
        return None
    refusal = f"worker {worker.name} is {worker.status}; only an offline worker can be deleted"
    if worker.stream_id is not None or worker.open_streams or worker.last_heartbeat is None:
        return f"{refusal} (drain it and stop its agent first)"
    from django.conf import settings

    timeout = settings.SIMPLETUNER["HEARTBEAT_TIMEOUT"]
    offline_by = worker.last_heartbeat + timedelta(seconds=timeout + settings.SIMPLETUNER["HEALTH_CHECK_INTERVAL"])
    wait = max(0, math.ceil((offline_by - (now or timezone.now())).total_seconds()))
    return (
        f"{refusal}. Its agent has no stream open: the health sweep takes the worker offline {timeout:g} s after its "
        f"last heartbeat, within about {wait} s (by {offline_by:%H:%M:%S} UTC); delete it then, or rotate its token "
        "to delete it at once (a rotated token's agent is refused)"
    )


def worker_delete(*, worker_id, actor):
    """Delete an offline (or never connected) worker, keeping its jobs and audit trail.

    Raise Conflict if the worker is online.
    """
    with audited_atomic():
        worker = lock_worker(worker_id)
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
        events.revoke_streams_on_commit(worker_id, token_ids, "worker deleted", code=protocol.WORKER_DELETED)


def worker_drain(*, worker_id, actor):
    """Stop new dispatch to the worker; it finishes its current job. Idempotent.

    The drain is durable: heartbeats and re-registration keep it, and an offline worker comes back draining.
    """
    with audited_atomic():
        worker = lock_worker(worker_id)
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
            workers_transition(workers=[worker], to=WorkerStatus.DRAINING, actor=actor, reason="drain requested")
        if worker.max_jobs > 1:  # a packing worker: every job and gang member on its GPUs, each of which it finishes
            job_ids = [job.pk for job in held_jobs(worker)]
            first = job_ids[0] if job_ids else None
            events.publish_on_commit(worker.pk, protocol.DRAIN, current_job_id=first, job_ids=job_ids)
        else:
            events.publish_on_commit(worker.pk, protocol.DRAIN, current_job_id=worker.current_job_id)
    return worker


# --- the agent's side of the protocol -----------------------------------------------------------


def worker_register_failed(*, reason, token_prefix, ip, name="", **details):
    """Audit a refused registration (bad or revoked token, another worker's id), with ``details`` besides."""
    with audited_atomic():
        audit_record(
            actor=Actor("worker", "", clean_text(str(name or "")[:150]), ip),
            action=actions.WORKER_REGISTRATION_FAILED,
            target_type="worker",
            details={"reason": reason, "token_prefix": clean_text(token_prefix), **details},
            success=False,
        )


def worker_throttled_audit(*, worker_id, address, details):
    """Audit worker ``worker_id`` past the rate of refusals or registrations (``worker.throttled``).

    Called by ``workers.throttling`` at most once per worker, kind and window.
    """
    with audited_atomic():
        audit_record(
            actor=Actor(ActorType.WORKER, str(worker_id), "", address),
            action=actions.WORKER_THROTTLED,
            target_type="worker",
            target_id=str(worker_id),
            details=details,
            success=False,
        )


def worker_stream_opened_fields(worker, *, stream_id, now):
    """Return the fields that record a new stream ``stream_id`` for the locked ``worker`` (its newest,
    so its current one); the worker's other open streams stay listed, those of dead processes go."""
    entries = streams_with(
        worker.open_streams,
        stream_id=stream_id,
        process=server_process_id(),
        live=live_server_processes(now=now, interval=presence_interval()),
    )
    return {"stream_id": stream_id, "stream_opened_at": now, "open_streams": entries}


def worker_stream_closed(*, worker_id, stream_id):
    """Forget the stream ``stream_id``: the worker's current stream becomes the newest one still open
    (None when none is), so closing a second stream never strands a worker whose first is open."""
    with transaction.atomic():
        worker = _LOCK_WORKER.first(pk=str(worker_id))
        if worker is None:
            return
        remaining = streams_without(worker.open_streams, stream_id)
        current = newest_stream_id(remaining) or (None if worker.stream_id == stream_id else worker.stream_id)
        Worker.objects.filter(pk=worker_id).update(open_streams=remaining, stream_id=current)


def heartbeat_interval():
    """Return the heartbeat period (seconds) agents are asked to keep."""
    from django.conf import settings

    return settings.SIMPLETUNER["HEARTBEAT_INTERVAL"]


def auth_failure_audit(*, action, kind, address, details):
    """Audit a refused token (``auth.failed``) or an address past the failure rate (``auth.throttled``).

    Called by ``workers.throttling`` at most twice per address and window, never with a whole token.
    """
    with audited_atomic():
        audit_record(
            actor=Actor(ActorType.WORKER if kind == TokenKind.WORKER else ActorType.USER, "", "", address),
            action=action,
            target_type="token",
            details={"kind": kind, **details},
            success=False,
        )
