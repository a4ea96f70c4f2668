"""GPU usage, computed from the attempts (no second bookkeeping): each attempt is charged its GPUs (``gpus``, set
at dispatch) times the seconds from its acknowledgement (``started_at``) to its end (``finished_at``: completed,
failed, declared lost, cancelled), or to now while it runs. And the GPU-hour quotas a submit must be within.

That rule is written here twice, in the two forms its readers need, and nowhere else: ``charged_attempts`` in SQL
(the usage API, the admin, /metrics and a quota sum over every attempt in one statement) and ``held_seconds`` in
Python (fair share's charge and a quota's "frees up at", over rows already read). ``test_usage`` holds them
equal on the same attempts and windows."""

from datetime import timedelta

from django.db.models import Count, F, FloatField, Func, Q, Sum, Value
from django.db.models.functions import Coalesce, Greatest, Least
from django.utils import timezone

from common.errors import ServiceError
from tenancy.models import LimitScope

from .models import JobAttempt

QUOTA_WINDOW = timedelta(days=30)
GROUPS = {"user": "job__submitted_by__username", "team": "job__team__name", "config": "job__config_name"}


class EpochSeconds(Func):
    """Seconds since the epoch of a date-time expression, as a float, on SQLite and PostgreSQL."""

    output_field = FloatField()

    def as_postgresql(self, compiler, connection, **extra):
        return self.as_sql(compiler, connection, template="EXTRACT(EPOCH FROM %(expressions)s)::double precision", **extra)

    def as_sqlite(self, compiler, connection, **extra):
        # Stored as text "YYYY-MM-DD HH:MM:SS[.ffffff]": whole seconds, plus the fraction as written (julianday()
        # would round to about 50 microseconds).
        sql, params = compiler.compile(self.source_expressions[0])
        fraction = f"CAST(COALESCE(NULLIF(substr({sql}, 20), ''), '0') AS REAL)"
        return f"(CAST(strftime('%%s', {sql}) AS REAL) + {fraction})", (*params, *params)


def _moment(value):
    return Value(value, output_field=JobAttempt._meta.get_field("started_at"))


def held_seconds(started_at, finished_at, *, since=None, until=None, now):
    """The seconds of ``[since, until)`` (either None: unbounded) during which an attempt acknowledged at
    ``started_at`` and ended at ``finished_at`` (None: running, up to ``now``) held its GPUs; never negative.
    The Python form of ``charged_attempts``' ``gpu_seconds`` (divided by the GPUs)."""
    begin = started_at if since is None else max(started_at, since)
    end = finished_at or now
    if until is not None:
        end = min(end, until)
    return max((end - begin).total_seconds(), 0.0)


def charged_attempts(*, since=None, until=None, now=None):
    """Return the attempts charged in ``[since, until)`` (either may be None: unbounded), each annotated with
    ``gpu_seconds``: its GPUs times the part of its run inside the window (a running one up to ``now``)."""
    now = now or timezone.now()
    end = Coalesce(F("finished_at"), _moment(now))
    start = F("started_at")
    attempts = JobAttempt.objects.filter(started_at__isnull=False)
    if until is not None:
        end = Least(end, _moment(until))
        attempts = attempts.filter(started_at__lt=until)
    if since is not None:
        start = Greatest(start, _moment(since))
        attempts = attempts.filter(Q(finished_at__isnull=True) | Q(finished_at__gt=since))
    seconds = Greatest(EpochSeconds(end) - EpochSeconds(start), Value(0.0))
    return attempts.annotate(gpu_seconds=seconds * F("gpus"))


def usage_rows(*, group_by, since, until, submitted_by=None, team=None, now=None):
    """Return ``[{"key", "gpu_seconds", "jobs", "attempts"}]`` per ``group_by`` (user, team, config) in
    ``[since, until)``, most used first; only ``submitted_by``'s jobs, or ``team``'s, when given. A job without
    a team (or whose submitter is gone) has the key None."""
    attempts = charged_attempts(since=since, until=until, now=now)
    if submitted_by is not None:
        attempts = attempts.filter(job__submitted_by=submitted_by)
    if team is not None:
        attempts = attempts.filter(job__team=team)
    rows = (
        attempts.values(key=F(GROUPS[group_by]))
        .annotate(total=Sum("gpu_seconds"), jobs=Count("job", distinct=True), attempts=Count("id"))
        .order_by()
    )
    found = [
        {"key": row["key"], "gpu_seconds": round(row["total"] or 0.0, 3), "jobs": row["jobs"], "attempts": row["attempts"]}
        for row in rows
    ]
    return sorted(found, key=lambda row: (-row["gpu_seconds"], str(row["key"])))


def usage_by_week(*, since, until, submitted_by=None, now=None, weeks_max=60):
    """Return ``[(week start, gpu_seconds)]`` for each week from ``since`` to ``until`` (at most ``weeks_max``)."""
    weeks, start = [], since
    while start < until and len(weeks) < weeks_max:
        end = min(start + timedelta(days=7), until)
        attempts = charged_attempts(since=start, until=end, now=now)
        if submitted_by is not None:
            attempts = attempts.filter(job__submitted_by=submitted_by)
        weeks.append((start, attempts.aggregate(total=Sum("gpu_seconds"))["total"] or 0.0))
        start = end
    return weeks


def usage_totals(*, now=None):
    """Return ``{(team name or "", username or ""): gpu_seconds}`` over all time (running attempts up to now)."""
    rows = charged_attempts(now=now).values(team=F("job__team__name"), user=F("job__submitted_by__username"))
    return {(r["team"] or "", r["user"] or ""): r["total"] or 0.0 for r in rows.annotate(total=Sum("gpu_seconds")).order_by()}


class QuotaExceeded(ServiceError):
    status_code = 403
    code = "gpu_quota_exceeded"


def _scope_filter(scope, *, user_id, team_id):
    return {LimitScope.USER: Q(job__submitted_by_id=user_id), LimitScope.TEAM: Q(job__team_id=team_id)}.get(scope, Q())


def quota_check(*, submitter, user_id, team_name, now=None):
    """Raise QuotaExceeded (403 ``gpu_quota_exceeded``) if the user, their team or the fleet has used up its
    ``gpu_hours_per_30_days`` over the last 30 days; the detail names the quota, the usage and when enough of
    it frees up (if nothing more runs). One query, only when a quota applies."""
    quotas = [
        (scope, name, limits["gpu_hours_per_30_days"])
        for scope, name, limits in submitter.limits(team_name)
        if limits["gpu_hours_per_30_days"] is not None
    ]
    if not quotas:
        return
    now = now or timezone.now()
    since = now - QUOTA_WINDOW
    team_id = submitter.teams[team_name][0] if team_name is not None else None
    scopes = {scope: _scope_filter(scope, user_id=user_id, team_id=team_id) for scope, _, _ in quotas}
    charged = charged_attempts(since=since, until=now, now=now)
    sums = charged.aggregate(**{scope: Sum("gpu_seconds", filter=where) for scope, where in scopes.items()})
    used = {scope: total or 0.0 for scope, total in sums.items()}
    over = [(scope, name, hours) for scope, name, hours in quotas if used[scope] >= hours * 3600]
    if not over:
        return
    frees = {scope: _frees_at(charged.filter(scopes[scope]), hours * 3600, since=since, now=now) for scope, _, hours in over}
    never = now + 2 * QUOTA_WINDOW  # a quota of 0 never frees up: it sorts last
    scope, name, hours = max(over, key=lambda quota: frees[quota[0]] or never)
    who = {LimitScope.USER: "your", LimitScope.TEAM: f"team {name}'s", LimitScope.GLOBAL: "the fleet's"}[scope]
    at = frees[scope]
    when = f"enough frees up at {at:%Y-%m-%d %H:%M:%S} UTC if nothing more runs" if at else "a quota of 0 never frees up"
    raise QuotaExceeded(
        f"{who} quota of {hours:g} GPU-hours per 30 days is used up: {used[scope] / 3600:.2f} GPU-hours used since "
        f"{since:%Y-%m-%d %H:%M} UTC; {when}",
        extra={
            "quota": {"scope": scope, "name": name, "gpu_hours_per_30_days": hours},
            "used_gpu_hours": round(used[scope] / 3600, 4),
            "frees_at": at.isoformat() if at else None,
        },
    )


def _frees_at(attempts, quota_seconds, *, since, now):
    """Return the first moment at which the usage of ``attempts`` over the 30 days before it falls below
    ``quota_seconds``, if nothing more runs (a running attempt counts up to now); None for a quota of 0."""
    if quota_seconds <= 0:
        return None
    runs = [(a.started_at, a.finished_at, a.gpus) for a in attempts.only("started_at", "finished_at", "gpus")]

    def used(at):  # nothing more runs: the window ending at ``at`` holds what ran until now
        return sum(held_seconds(*run[:2], since=at - QUOTA_WINDOW, until=now, now=now) * run[2] for run in runs)

    low, high = now, now + QUOTA_WINDOW  # 30 days on, every run so far has left the window
    for _ in range(40):  # to well under a second
        middle = low + (high - low) / 2
        low, high = (middle, high) if used(middle) >= quota_seconds else (low, middle)
    return high.replace(microsecond=0) + timedelta(seconds=1)
