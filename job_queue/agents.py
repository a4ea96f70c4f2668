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
from audit.services import Actor, audit_record, audited_atomic
from common.errors import Conflict, StaleReport
from common.pipeline import first_rows
from worker_agent import protocol
from workers.models import Worker, WorkerStatus
from workers.services import (
    lock_worker,
    token_touch,
    worker_stream_opened_fields,
    worker_token_sql,
)
from workers.capabilities import parse_capabilities
from workers.streams import agent_key, newest_stream_id, other_agents_streams, serving_entry
from workers.throttling import worker_refused
from workers.transitions import workers_transition

from .dispatch import (
    dispatch_for_worker,
    dispatch_on_commit,
    job_redeliver_on_commit,
    worker_jobs_over,
    job_resume_payload,
    redispatch_on_commit,
    worker_rest_and_offer,
    workers_free_and_offer,
)
from .models import JOB_ACTIVE, GangMember, Job, JobStatus
from .reports import attempt_spoke, job_record_progress, job_report_refused_audit
from .selectors import jobs_waiting_for
from .services import lock_job
from . import gangs, packing
from .packing import packing_fields
from .takeover import remember_replaced, replace_agents
from .transitions import jobs_give_back_gpus, jobs_release, operator_interruption

logger = logging.getLogger(__name__)

def worker_register(*, worker_id, data, actor, instance=None):
    """Record a (re)connecting agent's capabilities and reconcile the job it says it is running.

    Return the register response: ``worker_id``, ``status`` and, when the agent reported a job,
    ``resume_job`` (still its own and active) or ``abandon_job`` (anything else). An agent whose
    ``instance`` is not that of the agent the worker's stream serves (one of them says none, or they
    differ) takes the worker over: the streams of the agent before are told (``takeover.replace_agents``) and
    get no job any more; the worker gets jobs again once the new agent's stream opens. Raise Conflict
    (409, ``protocol.AGENT_REPLACED``), changing nothing, for an agent another one took the worker over from.
    """
    caps = parse_capabilities(data)
    caps.update(packing_fields(data, caps["gpu_count"]))
    # Multi-node jobs (job_queue.gangs): only an agent that says it runs a member is made one; rank 0 is reached at
    # its advertised address, else at the one it registered from.
    caps.update(
        multi_node=bool(data.get("multi_node")),
        advertise_address=str(data.get("advertise_address") or "").strip(),
        registered_address=(actor.ip or "")[:64],
    )
    packs = caps["max_jobs"] > 1
    reported = _reported_jobs(data)
    reported_job_id = data.get("current_job_id") or (reported[0][0] if reported else None)
    now = timezone.now()
    with audited_atomic():
        worker = lock_worker(worker_id)
        if instance and instance in (worker.replaced_instances or ()):
            serving = f"{worker.agent_name or 'an agent'} on {worker.hostname or 'an unknown host'}"
            raise Conflict(
                f"another agent took this worker over with the same token ({serving}); this agent stops",
                code=protocol.AGENT_REPLACED,
                extra={"agent_name": worker.agent_name, "agent_host": worker.hostname},
            )
        held = _locked_held_jobs(worker)
        response = {"worker_id": worker.pk}
        resumed, abandoned = [], []
        for job_id, attempt in reported if packs else reported[:1]:
            job = next((job for job in held if job.pk == job_id), None)
            if _names_current_attempt(job, job_id, attempt) and not gangs.part_over(job) and job not in resumed:
                resumed.append(job)
            else:
                abandoned.append(job_id)
        if resumed:
            gangs.acknowledge_by(worker=worker, jobs=resumed, actor=actor, reason="re-registered naming the job", now=now)
        left = [job for job in held if job not in resumed]
        holding = [job.pk for job in left if job.holds_gpus]  # (read before the release below clears it)
        for job in left:
            # The agent came back without the job we gave it: that attempt is over.
            _release_held_job(job=job, worker=worker, actor=actor, reason="worker re-registered without its job")
        if holding:  # a cancelled one too, a gang member's: the agent runs it no more
            jobs_give_back_gpus(job_ids=holding, worker_ids=[worker.pk])
        if reported_job_id:
            reported_job_id = str(reported_job_id)
            first = next((job for job in resumed if job.pk == reported_job_id), None)
            if first is not None:
                response["resume_job"] = job_resume_payload(first)
            else:
                response["abandon_job"] = reported_job_id
        if "max_jobs" in data:  # an agent that can pack (protocol.RegisterResponse): every job it reported
            response.update(
                max_jobs=caps["max_jobs"],
                resume_jobs=[job_resume_payload(job) for job in resumed],
                abandon_jobs=abandoned,
            )
        placement = _placement(worker, caps, resumed)
        resume = resumed[0] if resumed else None
        if worker.agent_instance and worker.agent_instance != instance:
            remember_replaced(worker, [worker.agent_instance])  # the agent that registered before: never back
        serving = serving_entry(worker)
        streams = {}
        if serving is not None and (serving.get("instance") or instance) and serving.get("instance") != instance:
            kept, replaced = other_agents_streams(worker.open_streams, instance)
            streams = {"open_streams": kept, "stream_id": newest_stream_id(kept)}
            replace_agents(worker=worker, replaced=replaced, name=caps["agent_name"], host=caps["hostname"], actor=actor)
        worker.max_jobs = caps["max_jobs"]  # what the agent can do now: the resting status and offer follow it
        worker_rest_and_offer(
            worker=worker,
            busy=resume is not None,
            actor=actor,
            reason="registered",
            last_heartbeat=now,
            connected_at=now,
            agent_instance=instance or "",
            **placement,
            **caps,
            **streams,
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
                **({"max_jobs": caps["max_jobs"], "gpu_slots": caps["gpu_slots"], "resumed_jobs": [j.pk for j in resumed]} if packs else {}),
                "agent_persistent": data.get("persistent"),
                "agent_name": caps["agent_name"],
            },
        )
    response["status"] = worker.status
    response["worker_type"] = worker.worker_type
    response["name"] = worker.name
    response["draining"] = worker.drain_requested_at is not None
    return response


def _reported_jobs(data):
    """The ``(job id, attempt)`` pairs a registration says the agent runs: its ``running_jobs`` (an agent that packs),
    with ``current_job_id`` first when it is not among them; or ``current_job_id`` alone."""
    reported = [(str(item["job_id"]), item.get("attempt") or None) for item in data.get("running_jobs") or ()]
    current = data.get("current_job_id") or None
    if current and str(current) not in {job_id for job_id, _ in reported}:
        reported.insert(0, (str(current), data.get("current_attempt") or None))
    return reported


def _locked_held_jobs(worker):
    """The jobs locked ``worker`` holds, locked (after the worker, the order every worker-side service locks in):
    its current job, and on a packing worker every job on its GPUs."""
    held = packing.held_jobs(worker.pk, lock=True) if worker.packs else []
    if worker.current_job_id and worker.current_job_id not in {job.pk for job in held}:
        job = lock_job(worker.current_job_id)
        if job is not None:
            held.insert(0, job)
    return held


def _placement(worker, caps, resumed):
    """The fields placing the ``resumed`` jobs on ``worker`` as the agent registering with ``caps`` runs them: one
    that does not pack holds the first as ``current_job`` (a gang member under its rank; the others were not
    resumed); a packing one holds each on its GPUs (a job it held whole before holds every slot; a gang member's are
    its member's) and has the rest free."""
    if caps["max_jobs"] <= 1:
        extra = [job.pk for job in resumed if job.holds_gpus]
        if extra:
            Job.objects.filter(pk__in=extra).update(holds_gpus=False, gpu_indices=None)
            GangMember.objects.filter(job_id__in=extra, worker_id=worker.pk).update(holds_gpus=False, gpu_indices=None)
        first = resumed[0] if resumed else None
        member = gangs.member_of(first, worker) if gangs.is_gang(first) else None
        return {"current_job": first, "gang_rank": member.rank if member is not None else 0, "gpus_free": 0}
    slots = _Slots(caps, pk=worker.pk)
    for job in resumed:
        if not job.holds_gpus or not set(job.gpu_indices or ()) <= set(caps["gpu_slots"]):
            others = [j for j in resumed if j is not job and j.holds_gpus]
            try:
                job.gpu_indices = packing.allocate(slots, job, others)
            except ValueError:  # the agent came back with fewer slots than its jobs hold: it holds them all
                job.gpu_indices = list(caps["gpu_slots"])
            job.holds_gpus = True
            if gangs.is_gang(job):  # its member here holds them; the job itself holds none (job_queue.packing)
                GangMember.objects.filter(job=job, lease_id=job.lease_id, worker_id=worker.pk).update(
                    gpu_indices=job.gpu_indices, holds_gpus=True
                )
            else:
                Job.objects.filter(pk=job.pk).update(gpu_indices=job.gpu_indices, holds_gpus=True)
    return {"current_job": None, "gang_rank": 0, "gpus_free": packing.room(slots, resumed)}


class _Slots:
    """A worker as a registration describes it: its id, ``max_jobs`` and ``gpu_slots`` (what ``packing`` reads)."""

    def __init__(self, caps, *, pk):
        self.pk, self.max_jobs, self.gpu_slots = pk, caps["max_jobs"], caps["gpu_slots"]


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
        if worker.packs:
            answer = _record_packed_heartbeat(worker=worker, data=data, now=now, actor=actor)
            refused = answer is None
        else:
            refused = bool(reported_job_id) and str(reported_job_id) != worker.current_job_id
            if not refused:
                held = _record_heartbeat(worker=worker, data=data, reported_job_id=reported_job_id, now=now, actor=actor)
                # A member of a multi-node job whose attempt ended (told to stop) still names it: it stops its copy.
                refused = held is not None and gangs.stale_member(worker, held)
            if not refused:
                answer = {
                    "status": worker.status,
                    "draining": worker.drain_requested_at is not None,
                    "current_job_id": worker.current_job_id,
                    # The attempt the worker holds the job it named under: an agent naming another attempt was not
                    # acknowledged.
                    "current_attempt": held.lease_id if held is not None else None,
                }
                if "jobs" in data:
                    active = held is not None and held.status in JOB_ACTIVE
                    answer["jobs"] = [{"job_id": held.pk, "attempt": held.lease_id}] if active else []
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
    return answer


def _heartbeat_jobs(data):
    """The jobs a heartbeat names, ``{job id: the HeartbeatJob}``: its ``jobs``, and ``current_job_id`` (with the
    heartbeat's own attempt, progress and log tail) when they do not list it."""
    named = {str(item["job_id"]): item for item in data.get("jobs") or ()}
    current = data.get("current_job_id") or None
    if current and str(current) not in named:
        named[str(current)] = {key: data.get(key) for key in ("attempt", "progress", "log_tail")}
    return named


def _record_packed_heartbeat(*, worker, data, now, actor):
    """Write a heartbeat of locked packing ``worker``: liveness, metrics, and for each job it names and holds, the
    acknowledgement (under that job's attempt), its progress and completed checkpoints. A cancelled job it holds
    and no longer names has stopped: its GPUs are freed. Return the answer, with ``jobs`` (every job held on the
    worker, with its attempt) for a heartbeat that sent ``jobs``; or None when it names, without ``jobs``, a
    ``current_job_id`` it does not hold (the caller's 409)."""
    named = _heartbeat_jobs(data)
    held = {job.pk: job for job in packing.held_jobs(worker.pk, lock=True)}
    live = {job_id: job for job_id, job in held.items() if not gangs.part_over(job)}  # a member told to stop is not
    current = str(data.get("current_job_id") or "") or None
    if current and "jobs" not in data and current not in live:
        return None
    metrics = {k: data[k] for k in protocol.HEARTBEAT_METRIC_FIELDS if k in data}
    fields = {"last_heartbeat": now, **({"metrics": metrics} if metrics else {})}
    if worker.status == WorkerStatus.OFFLINE:
        worker_rest_and_offer(worker=worker, actor=actor, reason="heartbeat after being offline", **fields)
    else:
        Worker.objects.filter(pk=worker.pk).update(**fields)
    acknowledged = [job for job in live.values() if job.pk in named and _names_current_attempt(job, job.pk, named[job.pk].get("attempt"))]
    gangs.acknowledge_by(worker=worker, jobs=acknowledged, actor=actor, reason="heartbeat names the job", now=now)
    for job in acknowledged:
        item = named[job.pk]
        attempt_spoke(job=job, data=item, actor=actor, now=now)
        if item.get("progress") is not None or item.get("log_tail") is not None:
            job_record_progress(job_id=job.pk, worker=worker, data=item)
    # A cancelled job, or a gang member whose part is over, that the agent no longer names has stopped: its GPUs are freed.
    stopped = [job_id for job_id, job in held.items() if job_id not in named and (job.status == JobStatus.CANCELLED or job_id not in live)]
    if stopped:  # the agent runs them no more
        worker_jobs_over(worker=worker, job_ids=stopped, actor=actor, reason="agent reports no job after cancel")
    answer = {
        "status": worker.status,
        "draining": worker.drain_requested_at is not None,
        "current_job_id": current if current in live else None,
        "current_attempt": live[current].lease_id if current in live else None,
    }
    if "jobs" in data:
        answer["jobs"] = [{"job_id": job.pk, "attempt": job.lease_id} for job in live.values() if job.status in JOB_ACTIVE]
    return answer


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
    if not secret or data.get("progress") is not None or data.get("log_tail") is not None or data.get("jobs"):
        return None  # (jobs: an agent that packs names its jobs; each is reconciled by the full path)
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
    if reported_job_id is None:
        params.append(WorkerStatus.IDLE)
    else:
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
        # Holding a job while the agent runs nothing is reconciled by worker_heartbeat; so is a packing worker
        # that is not idle (it holds jobs without current_job: job_queue.packing).
        where.append(f"{col(worker, 'current_job')} IS NULL AND ({col(worker, 'max_jobs')} <= 1 OR {col(worker, 'status')} = %s)")
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
        worker_rest_and_offer(worker=worker, actor=actor, reason="heartbeat after being offline", **fields)
    else:
        Worker.objects.filter(pk=worker.pk).update(**fields)
    if reported_job_id:
        job = lock_job(worker.current_job_id)
        if _names_current_attempt(job, str(reported_job_id), data.get("attempt")):
            gangs.acknowledge_by(worker=worker, jobs=[job], actor=actor, reason="heartbeat names the job", now=now)
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
        held = _locked_held_jobs(worker)
        changes = bool(held) or worker.status not in (WorkerStatus.OFFLINE, WorkerStatus.CONNECTING)
        holding = [job.pk for job in held if job.holds_gpus]  # (read before the release below clears it)
        for job in held:  # every job it held, its current one or those on its GPUs
            _release_held_job(job=job, worker=worker, actor=actor, reason=reason)
        if holding:  # a cancelled one too, a gang member's
            jobs_give_back_gpus(job_ids=holding, worker_ids=[worker.pk])
        if worker.status not in (WorkerStatus.OFFLINE, WorkerStatus.CONNECTING):
            workers_transition(
                workers=[worker], to=WorkerStatus.OFFLINE, actor=actor, reason=reason, current_job=None, gpus_free=0
            )
        elif worker.current_job_id or worker.gpus_free:
            Worker.objects.filter(pk=worker.pk).update(current_job=None, gpus_free=0)
        if changes:
            audit_record(
                actor=actor,
                action=actions.WORKER_DISCONNECTED,
                target_type="worker",
                target_id=worker.pk,
                details={"reason": reason, "worker_type": worker.worker_type},
            )
    return {"status": worker.status}


def worker_stream_opened(*, worker_id, stream_id, replaying, instance=None, actor=None):
    """Mark the worker's stream open, serving the worker from now on; hand it work: re-send an unacknowledged
    dispatch, or dispatch anew.

    ``replaying`` is True when the agent resumes with Last-Event-ID (the library replays what it missed).
    The newest stream serves: the worker's streams of any other agent (another ``instance``, or none said,
    as SimpleTuner's released agent says none) are told another agent took over (``takeover.replace_agents``);
    earlier streams of the same instance (a reconnect) are left as they are.
    """
    with audited_atomic():
        worker = lock_worker(worker_id)
        fields = worker_stream_opened_fields(worker, stream_id=stream_id, now=timezone.now())
        *others, opened = fields["open_streams"]
        opened.update(instance=instance, name=worker.agent_name, host=worker.hostname)
        kept, replaced = other_agents_streams(others, instance)
        fields["open_streams"] = [*kept, opened]
        Worker.objects.filter(pk=worker.pk).update(**fields)
        actor = actor or Actor.for_worker(worker, "")
        replace_agents(worker=worker, replaced=replaced, name=worker.agent_name, host=worker.hostname, actor=actor)
        if replaced and worker.packs:
            _release_packed_jobs_of_agent_replaced(worker=worker, actor=actor)
        elif replaced and worker.current_job_id:
            _release_job_of_agent_replaced(worker=worker, actor=actor)
        held = [job.pk for job in packing.held_jobs(worker.pk)] if worker.packs else [worker.current_job_id] if worker.current_job_id else []
        if not replaying:
            for job_id in held:  # each unacknowledged dispatch (job_redeliver_on_commit reads which)
                job_redeliver_on_commit(job_id=job_id, worker_id=worker.pk, to=agent_key(opened))
        if worker.status == WorkerStatus.IDLE:
            dispatch_on_commit(worker_id=worker.pk)
        elif worker.status == WorkerStatus.BUSY and worker.packs and worker.gpus_free:
            dispatch_on_commit(worker_id=worker.pk, beside=True)


def _release_job_of_agent_replaced(*, worker, actor):
    """Take back the job of the locked ``worker`` dispatched since its latest registration (so to the agent just
    replaced: the new one registered first, naming no job) without spending a retry; free the worker. The job
    goes out again as a new attempt, which the replaced agent cannot report on."""
    job = lock_job(worker.current_job_id)
    if job is None or job.dispatched_at is None or worker.connected_at is None or job.dispatched_at < worker.connected_at:
        return
    reason = f"dispatched to the agent another agent took {worker.name} over from"
    _release_held_job(job=job, worker=worker, actor=actor, reason=reason, interrupted_by=reason)
    worker_rest_and_offer(worker=worker, busy=False, actor=actor, reason=reason, current_job=None)


def _release_packed_jobs_of_agent_replaced(*, worker, actor):
    """``_release_job_of_agent_replaced`` for locked packing ``worker``: each of its jobs dispatched since its latest
    registration goes back to the queue without spending a retry, and gives its GPUs back."""
    taken = [
        job for job in packing.held_jobs(worker.pk, lock=True)
        if job.status in JOB_ACTIVE and worker.connected_at is not None and job.dispatched_at is not None
        and job.dispatched_at >= worker.connected_at
    ]
    if taken:
        reason = f"dispatched to the agent another agent took {worker.name} over from"
        for job in taken:
            _release_held_job(job=job, worker=worker, actor=actor, reason=reason, interrupted_by=reason)
        worker_jobs_over(worker=worker, job_ids=[job.pk for job in taken], actor=actor, reason=reason, at_once=False)


def job_reconcile_idle_agent(*, worker, actor):
    """Free a locked ``worker`` whose agent says it runs nothing while it holds a cancelled job, or a multi-node job
    it is no live member of any more (its attempt ended: ``gangs.stale_member``)."""
    job = lock_job(worker.current_job_id)
    if job is None or job.status == JobStatus.CANCELLED or gangs.stale_member(worker, job):
        workers_free_and_offer(workers=[worker], actor=actor, reason="agent reports no job after cancel")


def _names_current_attempt(job, job_id, attempt):
    """Whether an agent that says it holds ``job_id`` (and ``attempt``, if it says one) holds ``job``'s live attempt."""
    return job is not None and job.pk == job_id and job.status in JOB_ACTIVE and (not attempt or attempt == job.lease_id)


def _release_held_job(*, job, worker, actor, reason, interrupted_by=None):
    """Take a locked active ``job`` back from ``worker``, which no longer runs it (the caller updates the worker).

    A cancelled job only loses its worker (the caller clears ``current_job``); a job lost while its
    worker drains (``operator_interruption``), or ``interrupted_by`` what it names, spends no retry.
    """
    if gangs.is_gang(job):
        if gangs.live_member(job, worker) is None:  # its part is over (or another attempt runs): nothing is lost
            return
        gangs.attempt_lost(jobs=[job], outcome=gangs.MEMBER_LOST, lost_workers=[worker.pk])
        reason = f"{reason} ({worker.name}, a member of the {job.num_nodes}-node job)"
    elif job.worker_id != worker.pk:
        return
    if job.status in JOB_ACTIVE:
        by = interrupted_by or operator_interruption(worker)
        released = jobs_release(jobs=[job], actor=actor, reason=reason, interrupted_by=by)
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
