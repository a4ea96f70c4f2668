"""Operators' writes to jobs: submit, cancel, retry. Each is one transaction with its audit rows."""

from django.conf import settings
from django.db import IntegrityError
from django.utils import timezone

from audit import actions
from audit.services import audit_record, audited_atomic
from common.errors import Conflict, InvalidInput, NotFound
from common.inputs import GPU_COUNT_MAX, clean_labels
from common.prepared import PreparedQuery
from tenancy.models import Team
from tenancy.selectors import submitter
from tenancy.services import team_for_submit
from training_configs.services import config_for_submit, config_mark_used
from worker_agent import protocol
from workers import events as worker_events
from workers.models import Worker

from . import gangs
from .dispatch import dispatch_locked_job
from .models import JOB_ACTIVE, JOB_RETRYABLE, JOB_TERMINAL, TARGET_WORKER_TYPES, AttemptOutcome, GangMember, Job, JobStatus, JobTarget
from .transitions import attempts_finish, jobs_transition
from .usage import quota_check


# At most one row (by primary key): no ORDER BY. Every report, acknowledgement and operator action on a job
# takes this lock, so it is compiled once.
_LOCK_JOB = PreparedQuery(lambda *, pk: Job.objects.select_for_update().filter(pk=pk)[:1])


def lock_job(job_id):
    """Return the job row locked for update, or None."""
    return _LOCK_JOB.first(pk=str(job_id))  # str(), as the ORM makes a CharField's lookup value


def required_gpus(*, gpu_count, config):
    """Return the GPUs a job needs: the request's ``gpu_count``, else the config's ``num_processes``, else 0.

    Raise InvalidInput (``invalid_config``) unless ``num_processes`` is an integer from 0 to GPU_COUNT_MAX.
    """
    if gpu_count is not None:
        return gpu_count
    for key in ("num_processes", "--num_processes"):
        value = (config or {}).get(key)
        if value not in (None, ""):
            try:
                number = int(value)
            except (TypeError, ValueError, OverflowError):
                raise InvalidInput(f"config {key} must be an integer, got {value!r}"[:300], code="invalid_config") from None
            if not 0 <= number <= GPU_COUNT_MAX:
                raise InvalidInput(f"config {key} must be from 0 to {GPU_COUNT_MAX}, got {number}"[:300], code="invalid_config")
            return number
    return 0


def checked_num_nodes(num_nodes, *, target):
    """Return a job's ``num_nodes``: a whole number from 1 to the number of workers that may run a job of ``target``
    (the fleet's size); raise InvalidInput (``invalid_num_nodes``)."""
    if num_nodes is None:
        return 1
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise InvalidInput(f"num_nodes must be a whole number from 1, got {num_nodes!r}"[:300], code="invalid_num_nodes")
    if num_nodes > 1:
        fleet = Worker.objects.filter(worker_type__in=TARGET_WORKER_TYPES[target]).count()
        if num_nodes > fleet:
            raise InvalidInput(
                f"num_nodes must be from 1 to the fleet's size, {fleet} (the workers that may run a job of target "
                f"{target}), got {num_nodes}",
                code="invalid_num_nodes",
            )
    return num_nodes


def clean_worker_labels(worker_labels):
    """Return a job's label selectors (name -> glob) by the label rules; raise InvalidInput (``invalid_labels``)."""
    try:
        return clean_labels(worker_labels, what="label selector")
    except ValueError as exc:
        raise InvalidInput(f"worker_labels: {exc}", code="invalid_labels") from None


def job_submit(
    *,
    config_name,
    actor,
    config=None,
    dataloader=None,
    target=JobTarget.WORKER,
    worker_labels=None,
    gpu_count=None,
    num_nodes=1,
    priority=0,
    max_retries=None,
    retry_on_failure=False,
    team=None,
):
    """Queue a job and try to dispatch it at once, in one transaction; return ``(job, dispatched)``.

    ``config_name`` may name a stored config (``name`` or ``name@version``): the job runs that version,
    with the inline ``config``'s keys over its own (``training_configs.services.config_for_submit``).
    ``team`` names the team it is charged to (``tenancy.services.team_for_submit``: by default the
    submitter's one team).
    """
    charged = _charged_team(actor=actor, team=team)
    try:
        with audited_atomic():
            config_name, config, dataloader, stored = config_for_submit(config_name=config_name, config=config, dataloader=dataloader)
            config_mark_used(stored)
            job = _job_create(
                config_name=config_name,
                training_config=stored,
                actor=actor,
                config=config,
                dataloader=dataloader,
                target=target,
                worker_labels=worker_labels,
                gpu_count=gpu_count,
                num_nodes=num_nodes,
                priority=priority,
                max_retries=max_retries,
                retry_on_failure=retry_on_failure,
                team=charged,
            )
            return job, _dispatch_now(job)
    except IntegrityError:
        # The team was deleted after it was read (its key is checked at the commit): nothing was made.
        if charged is not None and not Team.objects.filter(pk=charged.pk).exists():
            raise NotFound(f"team {charged.name} was deleted meanwhile; nothing was submitted") from None
        raise


def _charged_team(*, actor, team):
    """Return the team a job of ``actor`` is charged to (None: none); raise unless they may submit it (their teams,
    their GPU-hour quotas: ``tenancy``, ``job_queue.usage``). One query, a second only when a GPU-hour quota applies."""
    who = submitter(actor.user_id)
    name = team_for_submit(submitter=who, team_name=team)
    quota_check(submitter=who, user_id=actor.user_id, team_name=name)
    return Team(pk=who.teams[name][0], name=name) if name is not None else None


def _dispatch_now(job):
    """Dispatch ``job``, just created in the caller's transaction (so no one else sees it yet); return whether it went."""
    return dispatch_locked_job(job) is not None


def _job_create(
    *,
    config_name,
    actor,
    config,
    dataloader,
    target,
    worker_labels,
    gpu_count,
    priority,
    max_retries,
    retry_on_failure,
    num_nodes=1,
    retry_of=None,
    training_config=None,
    team=None,
):
    """Create a queued job with its audit row, in the caller's transaction."""
    config = config or {}
    job = Job.objects.create(
        retry_of=retry_of,
        training_config=training_config,
        config_name=config_name,
        config=config,
        dataloader=dataloader,
        target=target,
        worker_labels=clean_worker_labels(worker_labels),
        gpu_count=required_gpus(gpu_count=gpu_count, config=config),
        num_nodes=checked_num_nodes(num_nodes, target=target),
        priority=priority,
        max_retries=settings.SIMPLETUNER["JOB_MAX_RETRIES"] if max_retries is None else max_retries,
        retry_on_failure=retry_on_failure,
        submitted_by_id=actor.user_id,
        team=team,
    )
    audit_record(
        actor=actor,
        action=actions.JOB_SUBMITTED,
        target_type="job",
        target_id=job.pk,
        details={
            "config_name": config_name,
            "config_version": training_config.version if training_config else None,
            "target": target,
            "worker_labels": job.worker_labels,
            "gpu_count": job.gpu_count,
            **({"num_nodes": job.num_nodes} if job.num_nodes > 1 else {}),
            "priority": priority,
            "max_retries": job.max_retries,
            "team": team.name if team else None,
            **({"retry_of": retry_of.pk} if retry_of else {}),
        },
    )
    return job


def job_cancel(*, job_id, actor):
    """Cancel a job. A queued job stops at once; a dispatched or running one is told to stop on its worker.

    Raise NotFound, or Conflict if the job already finished.
    """
    with audited_atomic():
        job = lock_job(job_id)
        if job is None:
            raise NotFound(f"job {job_id} does not exist")
        if job.status in JOB_TERMINAL:
            raise Conflict(f"job {job.pk} already {job.status}", code="job_finished")
        was = job.status
        audit_record(
            actor=actor,
            action=actions.JOB_CANCEL_REQUESTED,
            target_type="job",
            target_id=job.pk,
            details={"status": was, "worker": job.worker_id},
        )
        attempts_finish(lease_ids=[job.lease_id], outcome=AttemptOutcome.CANCELLED, error="cancelled by operator")
        jobs_transition(jobs=[job], to=JobStatus.CANCELLED, actor=actor, reason="cancelled", finished_at=timezone.now())
        if was in JOB_ACTIVE and job.num_nodes > 1:
            gangs.cancel_members(job)  # each member's worker stays busy until its agent reports it stopped
        elif was in JOB_ACTIVE and job.worker_id:
            # The worker stays busy with it until the agent reports the process has stopped.
            worker_events.publish_on_commit(job.worker_id, protocol.JOB_CANCEL, job_id=job.pk, attempt=job.lease_id)
    return job


def job_retry(*, job_id, actor):
    """Submit a new job with the settings of failed or cancelled job ``job_id``; return ``(job, dispatched)``.

    The finished job stays as it was (its attempts and audit trail are history); the new one records
    which job it retries. Raise NotFound, or Conflict if the job is queued, running or completed, if its
    worker is still stopping it (a cancel not yet confirmed), or if an earlier retry of it is unfinished.
    """
    with audited_atomic():
        original = lock_job(job_id)  # two retries of one job at once: the second sees the first's
        if original is None:
            raise NotFound(f"job {job_id} does not exist")
        if original.status not in JOB_RETRYABLE:
            raise Conflict(
                f"job {original.pk} is {original.status}; only failed or cancelled jobs can be retried",
                code="job_not_retryable",
            )
        stopping_on = Worker.objects.filter(current_job_id=original.pk).values_list("name", flat=True).first()
        if stopping_on is None and original.holds_gpus:  # still on its packing worker's GPUs
            stopping_on = original.worker_name
        if stopping_on is None and original.num_nodes > 1:  # a member still on a packing worker's GPUs
            stopping_on = GangMember.objects.filter(job=original, holds_gpus=True).values_list("worker_name", flat=True).first()
        if stopping_on is not None:
            raise Conflict(
                f"job {original.pk} is still stopping on worker {stopping_on}; retry it once it has stopped",
                code="job_still_stopping",
            )
        pending = original.retries.exclude(status__in=JOB_TERMINAL).values_list("pk", "status").first()
        if pending is not None:
            raise Conflict(
                f"job {original.pk} was already retried as {pending[0]}, which is {pending[1]}",
                code="job_already_retried",
            )
        job = _job_create(
            config_name=original.config_name,
            training_config=original.training_config,
            config=original.config,
            dataloader=original.dataloader,
            target=original.target,
            worker_labels=original.worker_labels,
            gpu_count=original.gpu_count,
            num_nodes=original.num_nodes,
            priority=original.priority,
            max_retries=original.max_retries,
            retry_on_failure=original.retry_on_failure,
            retry_of=original,
            team=original.team,
            actor=actor,
        )
        audit_record(
            actor=actor,
            action=actions.JOB_RETRIED,
            target_type="job",
            target_id=original.pk,
            details={"status": original.status, "new_job": job.pk},
        )
        return job, _dispatch_now(job)
