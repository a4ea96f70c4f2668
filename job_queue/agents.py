"""The agent's side of the protocol: register, heartbeat, disconnect, stream opened, asking for work.

Each reconciles the worker with the job it holds, so each lives above both apps: it locks the worker,
then its job (the order every worker-side service locks in), and changes them only through
``workers.transitions`` and ``job_queue.transitions``.
"""

import functools
import logging

from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from artifacts.models import Checkpoint
from audit import actions
from audit.services import audit_record, audited_atomic
from common.errors import StaleReport
from common.pipeline import first_rows
from worker_agent import protocol
from workers.models import Worker, WorkerStatus
from workers.services import (
    lock_worker,
    parse_capabilities,
    token_touch,
    worker_stream_opened_fields,
    worker_token_sql,
)
from workers.throttling import worker_refused
from workers.transitions import worker_resting_status, workers_transition

from .dispatch import (
    dispatch_for_worker,
    dispatch_on_commit,
    job_redeliver_on_commit,
    job_resume_payload,
    redispatch_on_commit,
    workers_free_and_offer,
)
from .models import JOB_ACTIVE, Job, JobStatus
from .reports import attempt_spoke, job_record_progress, job_report_refused_audit
from .selectors import jobs_waiting_for
from .services import lock_job
from .transitions import jobs_acknowledge, jobs_release, operator_interruption

logger = logging.getLogger(__name__)


def worker_register(*, worker_id, data, actor):
    """Record a (re)connecting agent's capabilities and reconcile the job it says it is running.

    Return the register response: ``worker_id``, ``status`` and, when the agent reported a job,
    ``resume_job`` (still its own and active) or ``abandon_job`` (anything else).
    """
    caps = parse_capabilities(data)
    reported_job_id = data.get("current_job_id") or None
    now = timezone.now()
    with audited_atomic():
        worker = lock_worker(worker_id)
        assigned = lock_job(worker.current_job_id) if worker.current_job_id else None
        response = {"worker_id": worker.pk}
        resume = None
        if reported_job_id:
            reported_job_id = str(reported_job_id)
            if _names_current_attempt(assigned, reported_job_id, data.get("current_attempt")):
                resume = assigned
                jobs_acknowledge(jobs=[assigned], actor=actor, reason="re-registered naming the job", now=now)
                response["resume_job"] = job_resume_payload(assigned)
            else:
                response["abandon_job"] = reported_job_id
        if assigned is not None and resume is None:
            # The agent came back without the job we gave it: that attempt is over.
            _release_held_job(job=assigned, worker=worker, actor=actor, reason="worker re-registered without its job")
        workers_transition(
            workers=[worker],
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
                "agent_name": caps["agent_name"],
            },
        )
        if worker.status == WorkerStatus.IDLE:
            dispatch_on_commit(worker_id=worker.pk)
    response["status"] = worker.status
    response["worker_type"] = worker.worker_type
    response["name"] = worker.name
    response["draining"] = worker.drain_requested_at is not None
    return response


def worker_heartbeat(*, worker_id, data, actor):
    """Record liveness (and utilisation/progress if sent); return the worker's view of its state.

    A heartbeat that changes no state is recorded by ``worker_heartbeat_liveness``, the one place that decides
    what such a heartbeat is (the heartbeat's fast path records it there too); any other is handled here.
    Raise StaleReport if the agent names a job that is no longer its own; nothing is written then but the
    refusal's audit row, bounded per worker and window (``workers.throttling.worker_refused``). A heartbeat
    never takes a worker out of draining; an offline worker that heartbeats comes back.
    """
    now = timezone.now()
    answer = worker_heartbeat_liveness(worker_id=worker_id, data=data, now=now)
    if answer is not None:  # it changed no state: recorded by the one rule that decides so
        return answer
    reported_job_id = data.get("current_job_id") or None
    with audited_atomic():
        worker = lock_worker(worker_id)
        refused = bool(reported_job_id) and str(reported_job_id) != worker.current_job_id
        if not refused:
            held = _record_heartbeat(worker=worker, data=data, reported_job_id=reported_job_id, now=now, actor=actor)
    if refused:
        # Always the 409 that makes a returning agent stop its copy; its audit row is bounded (workers.throttling).
        worker_refused(
            worker_id=worker.pk,
            address=actor.ip,
            record=lambda previous: job_report_refused_audit(
                actor=actor,
                job_id=str(reported_job_id),
                details={"reported": "heartbeat", "reason": protocol.JOB_NOT_OWNED, "worker": worker.pk},
                previous=previous,
            ),
        )
        raise StaleReport(
            f"job {reported_job_id} is not assigned to worker {worker.name}; stop it",
            code=protocol.JOB_NOT_OWNED,
            extra={"abandon_job": str(reported_job_id)},
        )
    return {
        "status": worker.status,
        "draining": worker.drain_requested_at is not None,
        "current_job_id": worker.current_job_id,
        # The attempt the worker holds the job it named under: an agent naming another attempt was not acknowledged.
        "current_attempt": held.lease_id if held is not None else None,
    }


def worker_heartbeat_liveness(*, data, secret=None, worker_id=None, now=None):
    """Record a heartbeat, if it changes no state, with one guarded UPDATE; return its response, or None. The
    heartbeat is the worker's whose token is ``secret`` (authenticated by the same statement) or, for one
    already authenticated, the worker ``worker_id``.

    Such a heartbeat (validated ``data``, as ``worker_heartbeat`` takes it) carries no progress or log,
    names no other worker, and comes from a worker that is not offline and either names no job while it
    holds none, or names the job it holds, already acknowledged (``running``), under that job's attempt
    if it says one, with no checkpoint of that attempt waiting to be completed. Only ``last_heartbeat``
    and the metrics are written (and the token marked used, as ``token_authenticate`` would), and no
    audit row, as ``worker_heartbeat`` does for it. Anything else, a token refused included, returns
    None having written nothing: give it to the full path.
    """
    sender = secret if worker_id is None else _Authenticated(worker_id)
    (answer,) = _record_liveness([(sender, data)], now=now or timezone.now())
    return answer


class _Authenticated(str):
    """The id of a worker whose heartbeat was authenticated already (by DRF), in place of a token's secret."""


def worker_heartbeats_liveness(batch):
    """``worker_heartbeat_liveness`` for each ``(secret, data)`` of ``batch``, in one transaction: one commit
    (one WAL flush on PostgreSQL, one turn of SQLite's write lock) for them all, and on PostgreSQL their
    UPDATEs sent in one pipeline (``common.pipeline``); return their answers in order.

    The workers are written in id order (the id each heartbeat claims), the order every worker-side
    service locks in. Should the transaction fail all the same (a deadlock, a connection lost), none of
    it is kept and each heartbeat is tried again on its own; one that fails again answers None, for the
    full path.
    """
    if len(batch) > 1:
        order = sorted(range(len(batch)), key=lambda i: (batch[i][1].get("worker_id") is None, str(batch[i][1].get("worker_id"))))
        try:
            with transaction.atomic():
                answers = _record_liveness([batch[i] for i in order], now=timezone.now())
            by_index = dict(zip(order, answers))
            return [by_index[i] for i in range(len(batch))]
        except DatabaseError as exc:
            logger.warning("%d heartbeats could not be recorded together (%s); recording each on its own", len(batch), exc)
    answers = []
    for secret, data in batch:
        try:
            answers.append(worker_heartbeat_liveness(secret=secret, data=data))
        except DatabaseError:
            logger.warning("A heartbeat could not be recorded by its lean path; the full path answers it", exc_info=True)
            answers.append(None)
    return answers


def _record_liveness(batch, *, now):
    """Write each plain heartbeat of ``batch`` (its guarded UPDATE, sent together with the others); mark the
    tokens due to be marked used in one more statement; return each one's answer, or None."""
    statements = [_liveness_statement(secret, data, now) for secret, data in batch]
    rows = iter(first_rows([statement for statement in statements if statement is not None]))
    answers, touched = [], []
    for (secret, _), statement in zip(batch, statements):
        row = next(rows) if statement is not None else None
        if row is None:
            answers.append(None)
            continue
        status, drain_requested_at, current_job_id, held_attempt, touch = row
        if touch:
            touched.append(secret)
        answers.append({"status": status, "draining": drain_requested_at is not None, "current_job_id": current_job_id,
                        "current_attempt": held_attempt})
    if touched:
        token_touch(plaintexts=touched, now=now)
    return answers


def _liveness_statement(secret, data, now):
    """Return ``(sql, params)`` of the guarded UPDATE recording the heartbeat ``data`` sent with the token
    ``secret`` (or by the worker an ``_Authenticated`` names), or None for a heartbeat that is not plain by its
    body alone (progress, a log tail). With ``_liveness_sql``, the one definition of a heartbeat that changes
    no state."""
    if not secret or data.get("progress") is not None or data.get("log_tail") is not None:
        return None
    reported_job_id = data.get("current_job_id") or None
    attempt = data.get("attempt") or None
    claimed = data.get("worker_id") or None
    metrics = {k: data[k] for k in protocol.HEARTBEAT_METRIC_FIELDS if k in data}
    if isinstance(secret, _Authenticated):
        token_worker, token_params, touch_due, touch_params = "%s", [str(secret)], "NULL", []
    else:
        token_worker, token_params, touch_due, touch_params = worker_token_sql(plaintext=secret, now=now)
    sql = _liveness_sql(connection.vendor, bool(metrics), claimed is not None, reported_job_id is not None, attempt is not None)
    params = [_prep(Worker, "last_heartbeat", now)]
    if metrics:
        params.append(_prep(Worker, "metrics", metrics))
    params += token_params
    if claimed is not None:
        params.append(str(claimed))
    params.append(WorkerStatus.OFFLINE)
    if reported_job_id is not None:
        params += [str(reported_job_id), str(reported_job_id), JobStatus.RUNNING]
        if attempt is not None:
            params.append(str(attempt))
        params += [_prep(Checkpoint, "last_upload_at", now), str(reported_job_id)]
    return sql.format(token_worker=token_worker, touch_due=touch_due), params + touch_params


def _prep(model, field, value):
    return model._meta.get_field(field).get_db_prep_save(value, connection)


@functools.lru_cache(maxsize=64)
def _liveness_sql(vendor, metrics, claimed, names_job, names_attempt):
    """The guarded UPDATE of ``worker_heartbeat_liveness`` for one shape of heartbeat (``{token_worker}`` and
    ``{touch_due}`` to be filled in with ``worker_token_sql``'s subqueries)."""
    qn = connection.ops.quote_name
    worker, job, checkpoint = Worker._meta, Job._meta, Checkpoint._meta

    def col(meta, name):
        return qn(meta.get_field(name).column)

    table = qn(worker.db_table)
    sets = [f"{col(worker, 'last_heartbeat')} = %s"] + ([f"{col(worker, 'metrics')} = %s"] if metrics else [])
    where = [f"{table}.{col(worker, 'id')} = {{token_worker}}"]
    if claimed:
        where.append(f"{table}.{col(worker, 'id')} = %s")
    where.append(f"{col(worker, 'status')} <> %s")
    held_attempt = "NULL"
    if not names_job:
        # Holding a job while the agent runs nothing is reconciled by worker_heartbeat.
        where.append(f"{col(worker, 'current_job')} IS NULL")
    else:
        job_table, job_id, lease = qn(job.db_table), col(job, "id"), col(job, "lease_id")
        attempt_check = f" AND j.{lease} = %s" if names_attempt else ""
        where.append(
            f"{col(worker, 'current_job')} = %s AND EXISTS (SELECT 1 FROM {job_table} j"
            f" WHERE j.{job_id} = %s AND j.{col(job, 'status')} = %s{attempt_check}"
            f" AND NOT EXISTS (SELECT 1 FROM {qn(checkpoint.db_table)} c WHERE c.{col(checkpoint, 'lease_id')} = j.{lease}"
            f" AND c.{col(checkpoint, 'completed_at')} IS NULL AND c.{col(checkpoint, 'last_upload_at')} < %s))"
        )
        held_attempt = f"(SELECT j.{lease} FROM {job_table} j WHERE j.{job_id} = %s)"
    returning = [col(worker, "status"), col(worker, "drain_requested_at"), col(worker, "current_job"), held_attempt]
    return (
        f"UPDATE {table} SET {', '.join(sets)} WHERE {' AND '.join(where)}"
        f" RETURNING {', '.join(returning)}, {{touch_due}}"
    )


def _record_heartbeat(*, worker, data, reported_job_id, now, actor):
    """Write a heartbeat of the locked ``worker``: liveness, metrics, progress, and any state it implies.

    Return the job the heartbeat named (it is the worker's own), or None.
    """
    metrics = {k: data[k] for k in protocol.HEARTBEAT_METRIC_FIELDS if k in data}
    fields = {"last_heartbeat": now}
    if metrics:
        fields["metrics"] = metrics
    if worker.status == WorkerStatus.OFFLINE:
        workers_transition(
            workers=[worker],
            to=worker_resting_status(worker, busy=worker.current_job_id is not None),
            actor=actor,
            reason="heartbeat after being offline",
            **fields,
        )
        if worker.status == WorkerStatus.IDLE:
            dispatch_on_commit(worker_id=worker.pk)
    else:
        Worker.objects.filter(pk=worker.pk).update(**fields)
    if reported_job_id:
        job = lock_job(worker.current_job_id)
        if _names_current_attempt(job, str(reported_job_id), data.get("attempt")):
            jobs_acknowledge(jobs=[job], actor=actor, reason="heartbeat names the job", now=now)
            attempt_spoke(job=job, data=data, actor=actor, now=now)
        if data.get("progress") is not None:
            job_record_progress(job_id=worker.current_job_id, worker=worker, data=data)
        return job
    if worker.current_job_id:
        # The agent runs nothing: a cancelled job it held is over, so the worker is free again.
        job_reconcile_idle_agent(worker=worker, actor=actor)
    return None


def worker_disconnect(*, worker_id, actor, reason="agent disconnected"):
    """Take the worker offline; a job it held goes back to the queue by the retry rules.

    A worker that never registered stays ``connecting``: there is no session to end. A disconnect that
    changes nothing (the worker is offline or connecting already, holding no job) writes no audit row, so
    repeating it cannot grow the audit log.
    """
    with audited_atomic():
        worker = lock_worker(worker_id)
        changes = worker.current_job_id is not None or worker.status not in (WorkerStatus.OFFLINE, WorkerStatus.CONNECTING)
        if worker.current_job_id:
            job = lock_job(worker.current_job_id)
            if job is not None:
                _release_held_job(job=job, worker=worker, actor=actor, reason=reason)
        if worker.status not in (WorkerStatus.OFFLINE, WorkerStatus.CONNECTING):
            workers_transition(workers=[worker], to=WorkerStatus.OFFLINE, actor=actor, reason=reason, current_job=None)
        elif worker.current_job_id:
            Worker.objects.filter(pk=worker.pk).update(current_job=None)
        if changes:
            audit_record(
                actor=actor,
                action=actions.WORKER_DISCONNECTED,
                target_type="worker",
                target_id=worker.pk,
                details={"reason": reason, "worker_type": worker.worker_type},
            )
    return {"status": worker.status}


def worker_stream_opened(*, worker_id, stream_id, replaying):
    """Mark the worker's stream open (beside any other open one); hand it work: re-send an unacknowledged
    dispatch, or dispatch anew.

    ``replaying`` is True when the agent resumes with Last-Event-ID (the library replays what it missed).
    """
    with audited_atomic():
        worker = lock_worker(worker_id)
        fields = worker_stream_opened_fields(worker, stream_id=stream_id, now=timezone.now())
        Worker.objects.filter(pk=worker.pk).update(**fields)
        if worker.current_job_id and not replaying:
            job_redeliver_on_commit(job_id=worker.current_job_id, worker_id=worker.pk)
        if worker.status == WorkerStatus.IDLE:
            dispatch_on_commit(worker_id=worker.pk)


def job_reconcile_idle_agent(*, worker, actor):
    """Free a locked ``worker`` whose agent says it runs nothing while it holds a cancelled job."""
    job = lock_job(worker.current_job_id)
    if job is None or job.status == JobStatus.CANCELLED:
        workers_free_and_offer(workers=[worker], actor=actor, reason="agent reports no job after cancel")


def _names_current_attempt(job, job_id, attempt):
    """Whether an agent that says it holds ``job_id`` (and ``attempt``, if it says one) holds ``job``'s live attempt."""
    return job is not None and job.pk == job_id and job.status in JOB_ACTIVE and (not attempt or attempt == job.lease_id)


def _release_held_job(*, job, worker, actor, reason):
    """Take a locked active ``job`` back from ``worker``, which no longer runs it (the caller updates the worker).

    A cancelled job only loses its worker (the caller clears ``current_job``); a job lost while its
    worker drains spends no retry (``operator_interruption``).
    """
    if job.worker_id == worker.pk and job.status in JOB_ACTIVE:
        released = jobs_release(jobs=[job], actor=actor, reason=reason, interrupted_by=operator_interruption(worker))
        redispatch_on_commit(released)


def worker_ask_for_work(*, worker_id):
    """Return whether a queued job fits the worker (what an ephemeral agent asks after its job).

    If one does and the worker is available, it is dispatched now: this is a write, whatever the
    HTTP method (the upstream agent asks with GET).
    """
    worker = Worker.objects.filter(pk=worker_id).first()
    if worker is None:
        return False
    has_jobs = jobs_waiting_for(worker)
    if has_jobs and worker.status == WorkerStatus.IDLE:
        dispatch_for_worker(worker.pk)
    return has_jobs
