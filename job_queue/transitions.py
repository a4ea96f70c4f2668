"""The one writer of ``Job.status`` and ``JobAttempt.outcome``, for sets of jobs, audited in the caller's transaction.

Callers lock the job rows first and pass model instances (a set of one for a single job). Here too is
the one requeue-or-fail rule (``jobs_release``) that every lost attempt goes through: the agent's own
reports, re-registration and disconnect, the stale-worker sweep and the unacknowledged-dispatch sweep.
"""

from collections import defaultdict
from typing import NamedTuple

from django.db.models import F
from django.utils import timezone

from audit import actions
from audit.services import audit_events, audit_write
from common import outbox
from common.errors import InvalidTransition
from common.inputs import TRAINER_ERROR_MAX_CHARS as ERROR_MAX_CHARS
from common.updates import update_rows
from worker_agent import protocol

from . import events
from .models import JOB_ACTIVE, JOB_TERMINAL, JOB_TRANSITIONS, AttemptOutcome, GangMember, Job, JobAttempt, JobStatus

# What a job that goes back to the queue forgets of its lost attempt.
BACK_TO_QUEUE = {"worker": None, "lease_id": None, "dispatched_at": None, "started_at": None, "gpu_indices": None, "holds_gpus": False}


def jobs_transition(*, jobs, to, actor, reason="", **fields):
    """Move each locked job in ``jobs`` to ``to``, writing ``fields``, with one audit row each.

    ``reason`` is a string or a function of the job. One UPDATE and one audit write, whatever the
    number of jobs. Raise InvalidTransition if the table in ``job_queue.models`` forbids it, or if a
    job's status changed since the caller read it. Return ``jobs``, updated in place.
    """
    audit_write(_jobs_move([_Move(jobs, to, reason, fields)], actor=actor))
    return jobs


class _Move(NamedTuple):
    """Jobs going to one status with the same fields."""

    jobs: list
    to: str
    reason: object  # a string or a function of the job
    fields: dict


def _jobs_move(moves, *, actor):
    """Make every move in one UPDATE, each row guarded by the status it was read in; return their audit rows, unsaved.

    Raise InvalidTransition (before writing anything) if the table forbids a move, or if a job's status
    changed since it was read (the caller's transaction then rolls back).
    """
    changes, read, audit = {}, {}, []
    for move in moves:
        for job in move.jobs:
            if job.status not in JOB_TRANSITIONS[move.to]:
                raise InvalidTransition(f"job {job.pk} cannot go from {job.status} to {move.to}")
            changes[job.pk] = dict(move.fields, status=move.to)
            read[job.pk] = {"status": job.status}
    updated = update_rows(Job.objects, changes, expect=read)
    if updated != len(changes):
        what = f"job {next(iter(changes))}" if len(changes) == 1 else f"{len(changes) - updated} job(s)"
        raise InvalidTransition(f"{what} changed status concurrently; the move is refused")
    changed = []
    for move in moves:
        rows = []
        for job in move.jobs:
            changed.append((job.pk, job.status, move.to))
            details = {
                "from": job.status,
                "to": move.to,
                "reason": move.reason(job) if callable(move.reason) else move.reason,
                "attempt": job.attempt_count,
            }
            if job.worker_id:
                details["worker"] = job.worker_id
            rows.append((job.pk, details))
            for name, value in move.fields.items():
                setattr(job, name, value)
            job.status = move.to
        audit += audit_events(actor=actor, action=actions.JOB_STATUS_CHANGED, target_type="job", rows=rows)
    outbox.emit_on_commit(events.STATUS_CHANGED, changes=changed, at=timezone.now())
    return audit


def attempt_open(*, job, worker, lease_id, number, now, gpu_indices=None):
    """Record a new attempt of ``job`` on ``worker`` (outcome pending), on ``gpu_indices`` of a packing worker."""
    return JobAttempt.objects.create(
        job=job, number=number, lease_id=lease_id, worker=worker, worker_name=worker.name, dispatched_at=now,
        gpus=job.gpu_count or worker.gpu_count,  # what its usage is charged for (job_queue.usage)
        gpu_indices=gpu_indices,
    )


def jobs_acknowledge(*, jobs, actor, reason, now=None, **fields):
    """Mark locked ``dispatched`` jobs acknowledged by their worker: ``running``, their attempt started.

    The one acknowledgement rule: a worker acknowledges a dispatch by ``starting`` (or any running
    report), and also by a heartbeat, a re-registration or a report that names the job (and its
    attempt, when it says one). Jobs not ``dispatched`` are left as they are. Return the jobs acknowledged.
    """
    now = now or timezone.now()
    fresh = [job for job in jobs if job.status == JobStatus.DISPATCHED]
    if not fresh:
        return []
    jobs_transition(jobs=fresh, to=JobStatus.RUNNING, actor=actor, reason=reason, started_at=now, **fields)
    JobAttempt.objects.filter(lease_id__in=[job.lease_id for job in fresh]).update(started_at=now)
    for job in fresh:
        outbox.emit_on_commit(events.ACKNOWLEDGED, dispatched_at=job.dispatched_at, started_at=now)
    return fresh


def attempts_finish(*, lease_ids, outcome, error="", now=None):
    """End the still-pending attempts among ``lease_ids`` with ``outcome``; an ended attempt keeps its own."""
    _attempts_end({lease: (outcome, error) for lease in lease_ids}, now=now)


def _attempts_end(ends, *, now=None):
    """End each pending attempt of ``{lease id: (outcome, error)}`` in one UPDATE; an ended attempt keeps its own."""
    now = now or timezone.now()
    changes = {
        lease: {"outcome": outcome, "error": error[:ERROR_MAX_CHARS], "finished_at": now}
        for lease, (outcome, error) in ends.items()
        if lease
    }
    update_rows(JobAttempt.objects, changes, key="lease_id", expect={lease: {"outcome": AttemptOutcome.PENDING} for lease in changes})


# Outcomes of an attempt taken back without its worker's word; a late completion of one is still good.
RECOVERABLE_OUTCOMES = (AttemptOutcome.LOST, AttemptOutcome.UNACKNOWLEDGED, AttemptOutcome.INTERRUPTED)


def jobs_give_back_gpus(*, job_ids=None, worker_ids=None):
    """The jobs ``job_ids`` (those of them on ``worker_ids``, when both are given), or every job of the packing
    workers ``worker_ids``, hold their GPUs no more (``Job.holds_gpus``; ``gpu_indices`` stays, the record of where
    they ran), and neither do their gang members on ``worker_ids`` (``GangMember.holds_gpus``; without ``worker_ids``,
    every member of ``job_ids``): two UPDATEs. The caller recounts the workers' ``gpus_free``."""
    jobs = Job.objects.filter(holds_gpus=True)
    members = GangMember.objects.filter(holds_gpus=True)
    if job_ids is not None:
        jobs = jobs.filter(pk__in=list(job_ids))
        members = members.filter(job_id__in=list(job_ids))
    if worker_ids is not None:
        jobs = jobs.filter(worker_id__in=list(worker_ids))
        members = members.filter(worker_id__in=list(worker_ids))
    jobs.update(holds_gpus=False)
    members.update(holds_gpus=False)


def recoverable_attempt(*, job, worker, lease_id):
    """Return ``job``'s attempt ``lease_id`` if ``worker`` may still complete it, else None.

    That is: the attempt was taken back without its worker's word (lost, or never acknowledged) and
    the job has not finished since: it waits in the queue, or another attempt runs it, which the late
    completion supersedes (``jobs_recover_completion``). Or that loss was the job's end: it failed for
    good with its retries used up, no attempt has run it since (its lease is still the lost one's), and no
    operator has retried it (the retry, a new job, runs the training again: this result is refused).
    """
    if not lease_id:
        return None
    if job.status == JobStatus.FAILED:  # failed by this attempt's loss alone, with no retry left
        retried = lease_id == job.lease_id and job.retries.exists()
        outcomes = (AttemptOutcome.LOST,) if lease_id == job.lease_id and not retried else ()
    elif job.status in JOB_TERMINAL or lease_id == job.lease_id:
        return None
    else:
        outcomes = RECOVERABLE_OUTCOMES
    return JobAttempt.objects.filter(job=job, lease_id=lease_id, worker_id=worker.pk, outcome__in=outcomes).first()


def jobs_recover_completion(*, job, attempt, actor, journal=False, now=None, **fields):
    """Complete locked ``job`` with its lost ``attempt``, whose worker finished it after all.

    The requeue is undone: the attempt ends ``completed``, a retry its loss spent is given back, and
    the job records the attempt and worker that ran it. A job that the loss failed for good (no retry
    left, none spent) is completed instead: the failure was the orchestrator's guess, the result is fact. An attempt that runs the job meanwhile (on
    another worker, or this one) is superseded: it ends ``superseded`` and the caller frees its worker
    and tells it to stop, so the trainer does not complete a second time. Return the superseded
    attempt's lease id, or None.
    """
    now = now or timezone.now()
    superseded = job.lease_id if job.status in JOB_ACTIVE else None
    if superseded:
        attempts_finish(
            lease_ids=[superseded],
            outcome=AttemptOutcome.SUPERSEDED,
            error=f"attempt {attempt.number} completed first (its result arrived late)",
            now=now,
        )
    undone_failure = job.status == JobStatus.FAILED
    refund = attempt.outcome == AttemptOutcome.LOST and job.retry_count > 0 and not undone_failure
    JobAttempt.objects.filter(pk=attempt.pk, outcome__in=RECOVERABLE_OUTCOMES).update(
        outcome=AttemptOutcome.COMPLETED, error="", finished_at=now
    )
    progress = fields.pop("progress", None) or dict(job.progress or {})
    progress["fraction"] = 1.0
    reason = f"late completion of attempt {attempt.number} on {attempt.worker_name}: " + (
        f"it supersedes attempt {job.attempt_count} on {job.worker_name}"
        if superseded
        else "the failure its loss caused (retries exhausted) is undone"
        if undone_failure
        else "its requeue is cancelled"
    )
    if journal:
        reason += f" ({protocol.FROM_JOURNAL})"
    jobs_transition(
        jobs=[job],
        to=JobStatus.COMPLETED,
        actor=actor,
        reason=reason,
        worker_id=attempt.worker_id,
        worker_name=attempt.worker_name,
        lease_id=attempt.lease_id,
        dispatched_at=attempt.dispatched_at,
        started_at=attempt.started_at or attempt.dispatched_at,
        finished_at=now,
        progress=progress,
        last_error="",
        retry_count=job.retry_count - refund,
        gpu_indices=attempt.gpu_indices,  # where that attempt ran; it holds no GPU now
        holds_gpus=False,
        **fields,
    )
    audit_write(
        audit_events(
            actor=actor,
            action=actions.JOB_COMPLETION_RECOVERED,
            target_type="job",
            rows=[
                (
                    job.pk,
                    {
                        "attempt": attempt.number,
                        "lease": attempt.lease_id,
                        "was": attempt.outcome,
                        "retry_refunded": refund,
                        "journal": journal,
                    }
                    | ({"superseded": superseded} if superseded else {})
                    | ({"failure_undone": True} if undone_failure else {}),
                )
            ],
        )
    )
    return superseded


class Released:
    """What ``jobs_release`` did: the ids requeued (to dispatch once committed) and failed for good."""

    def __init__(self):
        self.requeued = []
        self.failed = []

    def __bool__(self):
        return bool(self.requeued or self.failed)


def operator_interruption(worker):
    """Return the operator's action that ends a job lost on ``worker`` now (its drain), or None.

    An operator who drained a worker is taking it out of service: a job it loses meanwhile (the agent
    stopped, the machine switched off) is the operator's doing, not the job's, and spends no retry.
    """
    if worker is not None and worker.drain_requested_at is not None:
        return f"drain of {worker.name}"
    return None


def jobs_release(
    *, jobs, actor, reason, outcome=AttemptOutcome.LOST, acknowledged=False, interrupted_by=None, now=None
):
    """Take back locked active jobs whose current attempt is over (worker lost, dispatch never acknowledged, ...).

    The rule, in one place:
    - never acknowledged (``dispatched``): the attempt ends ``unacknowledged`` and the job goes back to
      the queue without spending a retry (the trainer never started);
    - ended by an operator's action (``interrupted_by``: a string, or a function of the job returning
      one or None, naming the action: a token rotation, a drain): the attempt ends ``interrupted`` and
      the job goes back to the queue without spending a retry, even with none left;
    - acknowledged (``running``): the attempt ends with ``outcome``; the job is requeued while retries
      remain, spending one, else fails for good with ``reason`` and the retries it used.
    ``acknowledged`` says the worker's own report ended the attempt, which acknowledges it even if it
    never said ``starting``. ``reason`` (a string or a function of the job) becomes ``last_error``. One
    UPDATE of the attempts, one of the jobs and one audit write, whatever the jobs and their fates.
    Return a ``Released``; the caller offers the requeued jobs to workers once committed.
    """
    now = now or timezone.now()
    released = Released()
    by = {job.pk: interrupted_by(job) if callable(interrupted_by) else interrupted_by for job in jobs}
    reasons = {job.pk: _reason(job, reason, by[job.pk]) for job in jobs}  # before any field changes
    why = lambda job: reasons[job.pk]  # noqa: E731
    final = lambda job: f"{why(job)}; retries exhausted ({job.retry_count} of {job.max_retries} used)"  # noqa: E731
    unacked = [] if acknowledged else [j for j in jobs if j.status == JobStatus.DISPATCHED]
    started = jobs if acknowledged else [j for j in jobs if j.status != JobStatus.DISPATCHED]
    for job in unacked:
        by[job.pk] = None  # never started: nothing of it was interrupted
    interrupted = [j for j in started if by[j.pk]]
    started = [j for j in started if not by[j.pk]]
    retry = [j for j in started if j.retry_count < j.max_retries]
    exhausted = [j for j in started if j.retry_count >= j.max_retries]
    _attempts_end(
        {j.lease_id: (AttemptOutcome.UNACKNOWLEDGED, why(j)) for j in unacked}
        | {j.lease_id: (AttemptOutcome.INTERRUPTED, why(j)) for j in interrupted}
        | {j.lease_id: (outcome, why(j)) for j in started},
        now=now,
    )
    previous = {j.pk: (j.worker_id, j.retry_count) for j in jobs}
    spend = dict(BACK_TO_QUEUE, retry_count=F("retry_count") + 1)
    audit = _jobs_move(
        [
            *_moves(unacked + interrupted, JobStatus.QUEUED, why, BACK_TO_QUEUE),
            *_moves(retry, JobStatus.QUEUED, why, spend),
            *_moves(exhausted, JobStatus.FAILED, final, {"finished_at": now, "holds_gpus": False}),
        ],
        actor=actor,
    )
    for job in retry:  # the instances show the value the UPDATE wrote, not the expression
        job.retry_count = previous[job.pk][1] + 1
    for group, spent in ((unacked + interrupted, False), (retry, True)):
        if group:
            audit += _requeued_rows(group, actor=actor, why=why, spent=spent, previous=previous, by=by)
            outbox.emit_on_commit(events.REQUEUED, count=len(group), retry_spent=spent)
    if exhausted:
        outbox.emit_on_commit(events.RETRIES_EXHAUSTED, count=len(exhausted))
    audit_write(audit)
    released.requeued = [j.pk for j in unacked + interrupted + retry]
    released.failed = [j.pk for j in exhausted]
    return released


def _moves(jobs, to, text, fields):
    """Return one move of ``jobs`` to ``to`` per distinct ``text(job)``, which is its reason and ``last_error``."""
    groups = defaultdict(list)
    for job in jobs:
        groups[text(job)].append(job)
    return [
        _Move(group, to, error, dict(fields, last_error=error[:ERROR_MAX_CHARS])) for error, group in groups.items()
    ]


def _reason(job, reason, interrupted_by):
    """Return why ``job``'s attempt ended, saying so when an operator's action ended it (no retry spent)."""
    text = reason(job) if callable(reason) else reason
    if interrupted_by and job.status != JobStatus.DISPATCHED:
        text = f"{text} (stopped by an operator's {interrupted_by}: no retry spent)"
    return text


def _requeued_rows(jobs, *, actor, why, spent, previous, by):
    return audit_events(
        actor=actor,
        action=actions.JOB_REQUEUED,
        target_type="job",
        rows=[
            (
                j.pk,
                {
                    "reason": why(j),
                    "retry_spent": spent,
                    "retry_count": j.retry_count,
                    "max_retries": j.max_retries,
                    "previous_worker": previous[j.pk][0],
                }
                | ({"interrupted_by": by[j.pk]} if by[j.pk] else {}),
            )
            for j in jobs
        ],
    )
