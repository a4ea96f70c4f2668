"""Running and GPU limits at dispatch (``tenancy.Limits``): whether one holds a queued job back, and why.

A job is under three scopes: the fleet, its team, its submitter; every figure set among them must leave
room for it (the tightest holds). ``max_running_jobs`` and ``max_gpus`` count the jobs dispatched or
running, a job's GPUs being its ``gpu_count`` or, for one that takes any worker, its worker's, on each of its nodes.
"""

from django.db.models import Count, Exists, F, OuterRef, Q, Sum, Value
from django.db.models.functions import Coalesce, NullIf

from tenancy.models import LimitScope, Limits

from .models import JOB_ACTIVE, Job

# A limit that dispatch applies (a GPU-hour quota is applied at submit, job_queue.usage).
_AT_DISPATCH = Q(max_running_jobs__isnull=False) | Q(max_gpus__isnull=False)
# A job without a team or a submitter is under no such scope: this id matches no row.
NO_ID = 0


def _scopes_of(team_id, user_id):
    return Q(scope=LimitScope.GLOBAL) | Q(team_id=team_id) | Q(user_id=user_id)


def limit_applies(*, team_id=None, user_id=None):
    """An EXISTS expression: whether a running or GPU limit applies to a job of ``team_id`` and ``user_id``
    (values, or ``OuterRef``s to the job's columns). A dispatch reads it in the statement that reads its
    first worker or job, so that with no limit set the limits cost no statement."""
    team_id = OuterRef("team_id") if team_id is None else team_id
    user_id = OuterRef("submitted_by_id") if user_id is None else user_id
    return Exists(Limits.objects.filter(_scopes_of(team_id, user_id)).filter(_AT_DISPATCH))


def any_limit():
    """An EXISTS expression: whether a running or GPU limit is set anywhere."""
    return Exists(Limits.objects.filter(_AT_DISPATCH))


# What matching a job to a worker reads of a candidate job, its limits' scopes included.
MATCHED_FIELDS = ("pk", "worker_labels", "gpu_count", "num_nodes", "team_id", "submitted_by_id")


def with_limits(jobs):
    """``jobs`` with ``limited`` (a running or GPU limit applies to the job) and ``any_limit`` (one is set anywhere)."""
    return jobs.annotate(limited=limit_applies(), any_limit=any_limit())


def any_limit_at_dispatch():
    """Return whether a running or GPU limit is set anywhere (one small read)."""
    return Limits.objects.filter(_AT_DISPATCH).exists()


def _job_gpus():
    """The GPUs an active job holds: its ``gpu_count``, else its worker's (rank 0's), on each of its ``num_nodes``."""
    return Coalesce(NullIf(F("gpu_count"), Value(0)), F("worker__gpu_count"), Value(0)) * F("num_nodes")


def _scope_keys(job):
    keys = [(LimitScope.GLOBAL, None)]
    if job.team_id is not None:
        keys.append((LimitScope.TEAM, job.team_id))
    if job.submitted_by_id is not None:
        keys.append((LimitScope.USER, job.submitted_by_id))
    return keys


class LimitBook:
    """The room left under the limits a transaction meets, read once per scope.

    With ``lock`` (a dispatch) the limits' rows are locked until the commit, so that dispatches under the
    same limit take turns and each counts what the one before it committed. Only the first read waits for
    a row; a later one in the same transaction skips rows another dispatch holds (no cycle of waits) and
    holds their jobs back for this transaction. Without ``lock``: a plain read (waiting reasons).
    """

    def __init__(self, *, lock):
        self._lock = lock
        self._locked_once = False
        self._room = {}  # (scope, id) -> None (no limit) | (what, limits row, running, gpus) | "busy"

    def hold(self, job, *, gpus):
        """Return why a limit holds ``job`` back from a worker where it would hold ``gpus`` GPUs, or None."""
        keys = _scope_keys(job)
        self.load([key for key in keys if key not in self._room])
        for key in keys:
            room = self._room[key]
            if room is None:
                continue
            if room == "busy":
                return "its limits are being applied by another dispatch"
            what, limits, running, held = room
            if limits.max_running_jobs is not None and running + 1 > limits.max_running_jobs:
                return f"{what} is at its limit of {_plural(limits.max_running_jobs, 'running job')}"
            if limits.max_gpus is not None and held + gpus > limits.max_gpus:
                return f"{what} is at its limit of {_plural(limits.max_gpus, 'GPU')} ({held} held; this job needs {gpus})"
        return None

    def load(self, keys):
        """Read the limits of ``keys`` (``(scope, id)``) and what their scopes run now: two statements at most."""
        if not keys:
            return
        where = Q()
        for scope, pk in keys:
            where |= {LimitScope.GLOBAL: Q(scope=scope), LimitScope.TEAM: Q(team_id=pk), LimitScope.USER: Q(user_id=pk)}[scope]
        rows = Limits.objects.filter(where).filter(_AT_DISPATCH).select_related("team", "user").order_by("pk")
        skipping = self._lock and self._locked_once
        read = rows.select_for_update(of=("self",), skip_locked=skipping) if self._lock else rows
        self._locked_once = self._locked_once or self._lock
        found = {_key(row): row for row in read}
        busy = []
        if skipping and len(found) < len(keys):  # a row absent may not exist, or be held by another dispatch
            busy = [key for key in rows.values_list("scope", "team_id", "user_id") if _key_of(*key) not in found]
            busy = [_key_of(*key) for key in busy]
        for key in keys:
            self._room[key] = None
        if not found:
            for key in busy:
                self._room[key] = "busy"
            return
        counts = {}
        for scope, pk in found:
            name = f"{scope}_{pk or 0}"
            where = {LimitScope.GLOBAL: None, LimitScope.TEAM: Q(team_id=pk), LimitScope.USER: Q(submitted_by_id=pk)}[scope]
            counts[f"{name}_n"] = Count("pk", filter=where)
            counts[f"{name}_g"] = Sum(_job_gpus(), filter=where)
        totals = Job.objects.filter(status__in=JOB_ACTIVE).aggregate(**counts)
        for (scope, pk), row in found.items():
            name = f"{scope}_{pk or 0}"
            self._room[(scope, pk)] = (_who(row), row, totals[f"{name}_n"] or 0, totals[f"{name}_g"] or 0)
        for key in busy:
            self._room[key] = "busy"


class Held(Exception):
    """A limit holds the job back whatever worker it is offered."""


def within_limits(book, job, worker):
    """Whether the limits (``book``; None: none applies) leave room for ``job`` on ``worker``. Raise Held if one
    holds it back on any worker (a running-jobs limit; GPUs, for a job that says how many it needs)."""
    if book is None or book.hold(job, gpus=job.gpu_count or worker.gpu_count) is None:
        return True
    if job.gpu_count or book.hold(job, gpus=0) is not None:
        raise Held
    return False


def _key_of(scope, team_id, user_id):
    return (scope, team_id or user_id)


def _key(limits):
    return _key_of(limits.scope, limits.team_id, limits.user_id)


def _who(limits):
    return "the fleet" if limits.scope == LimitScope.GLOBAL else str(limits)  # "team nlp", "user alice"


def _plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def limits_hold_reasons(jobs, *, gpus):
    """Return ``{job pk: why a limit holds it back}`` for those of queued ``jobs`` a limit holds (``gpus(job)``: the
    GPUs it would hold). A plain read: one statement, two when a limit applies to one of them."""
    book = LimitBook(lock=False)
    keys = {key for job in jobs for key in _scope_keys(job)}
    book.load(sorted(keys, key=lambda key: (key[0], key[1] or 0)))
    return {job.pk: reason for job in jobs if (reason := book.hold(job, gpus=gpus(job)))}
