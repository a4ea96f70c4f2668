"""Fair share: each share's decayed GPU usage, charged from the attempts, and the queue's order by it.

A share is a team, or the submitter of a job without a team (``Job.share``, kept by the database). Its
usage at time t is the sum of its GPU-seconds, each weighted by 2 ** (-(t - when) / half-life). A row of
``FairShare`` stores it as log2 of the sum weighted by 2 ** ((when - EPOCH) / half-life) instead: the same
order between shares at any instant (every share decays alike), never an overflow, and no update as
time passes. ``fairshare_charge`` (a sweep, every ``CHARGE_INTERVAL`` seconds) adds the GPU time the
attempts held since the last charge, running ones up to now, so the usage lags by that much at most.

The queue's order is (priority desc, the share's usage asc, submitted_at, id): ``FAIR_ORDER``, which the
dispatcher (``offered_jobs``) and a job's ``queue_position`` share.
"""

import math
from datetime import UTC, datetime

from django.conf import settings
from django.db import connection, transaction
from django.db.models import F, Lookup, OuterRef, Q, Subquery
from django.utils import timezone

from common.updates import update_rows

from .limits import MATCHED_FIELDS, with_limits
from .models import FairShare, Job, JobAttempt, JobStatus, targets_for_worker_type
from .usage import held_seconds

EPOCH = datetime(2020, 1, 1, tzinfo=UTC)
CHARGE_INTERVAL = 30  # seconds: how far fair-share usage may lag the GPU time held
CHARGE_BATCH = 5000  # attempts charged per transaction


def share_key(*, team_id, user_id):
    """Return the share of a job of ``team_id`` and ``user_id`` (what the database keeps in ``Job.share``)."""
    return team_id * 2 + 1 if team_id is not None else (user_id or 0) * 2


def _half_life():
    return settings.SIMPLETUNER["FAIRSHARE_HALF_LIFE"]


def _weight(at, half_life):
    return (at - EPOCH).total_seconds() / half_life


def usage_add(usage_log, gpu_seconds, at, *, half_life=None):
    """Return ``usage_log`` (None: nothing) with ``gpu_seconds`` charged at ``at`` added."""
    if gpu_seconds <= 0:
        return usage_log
    added = math.log2(gpu_seconds) + _weight(at, half_life or _half_life())
    if usage_log is None:
        return added
    high, low = max(usage_log, added), min(usage_log, added)
    return high + math.log2(1 + 2 ** (low - high))


def usage_at(usage_log, now, *, half_life=None):
    """Return the decayed GPU-seconds that ``usage_log`` stands for at ``now``."""
    if usage_log is None:
        return 0.0
    exponent = usage_log - _weight(now, half_life or _half_life())
    return 2**exponent if exponent < 1000 else math.inf


def share_usage():
    """The job's share's stored ``usage_log`` (null: nothing charged, which orders first)."""
    return Subquery(FairShare.objects.filter(key=OuterRef("share")).values("usage_log")[:1])


def fair_order():
    """The order the dispatcher offers queued jobs in; needs ``share_usage`` annotated."""
    return (F("priority").desc(), F("share_usage").asc(nulls_first=True), F("submitted_at").asc(), F("pk").asc())


# --- the dispatcher's reads ---------------------------------------------------------------------------


def _share_head(worker_type, gpu_count):
    """The first queued job of the outer share that a worker of ``worker_type`` with ``gpu_count`` GPUs may run
    (index ``job_share_order``)."""
    return (
        Job.objects.filter(
            status=JobStatus.QUEUED,
            share=OuterRef("key"),
            target__in=targets_for_worker_type(worker_type),
            gpu_count__lte=gpu_count,
        )
        .order_by("-priority", "submitted_at", "pk")
        .values("pk")[:1]
    )


class _AmongHeads(Lookup):
    """``id`` among the ids a subquery returns, read by primary key: on PostgreSQL ``= ANY(ARRAY(...))``, whose few
    values the planner looks up in the index (an ``IN`` it may answer by hashing a scan of the whole queue)."""

    lookup_name = "among"

    def as_sql(self, compiler, connection):
        lhs, lhs_params = self.process_lhs(compiler, connection)
        rhs, rhs_params = self.process_rhs(compiler, connection)
        template = "{} = ANY(ARRAY{})" if connection.vendor == "postgresql" else "{} IN {}"
        return template.format(lhs, rhs), (*lhs_params, *rhs_params)


Job._meta.get_field("id").register_lookup(_AmongHeads)


def offered_jobs(worker_type, *, gpu_count):
    """The head queued job of each share that a worker of ``worker_type`` may run, in ``fair_order``: one index
    probe per share, and a sort of those few heads, never of the backlog."""
    heads = FairShare.objects.annotate(head=Subquery(_share_head(worker_type, gpu_count))).values("head")
    return (
        Job.objects.filter(id__among=Subquery(heads), status=JobStatus.QUEUED)
        .annotate(share_usage=share_usage())
        .order_by(*fair_order())
    )


def heads_for_worker(worker_type, start, stop, *, gpu_count):
    """Rows ``start:stop`` of ``offered_jobs``, as much of each as matching needs (``job_queue.dispatch``)."""
    return with_limits(offered_jobs(worker_type, gpu_count=gpu_count).only(*MATCHED_FIELDS))[start:stop]


def first_head_for_worker(worker_type, *, gpu_count):
    """The first of ``offered_jobs`` that no other transaction holds, locked (SKIP LOCKED)."""
    return with_limits(offered_jobs(worker_type, gpu_count=gpu_count)).select_for_update(skip_locked=True, of=("self",))[:1]


def share_ensure(job):
    """Make sure queued ``job``'s share has its row, so the dispatcher's probe of the shares finds it."""
    key = share_key(team_id=job.team_id, user_id=job.submitted_by_id)
    FairShare.objects.bulk_create([FairShare(key=key)], ignore_conflicts=True)


def shares_ensure_queued():
    """Give each share with a queued job its row (jobs queued without the dispatcher's knowledge); return how many."""
    keys = set(Job.objects.filter(status=JobStatus.QUEUED).order_by().values_list("share", flat=True).distinct())
    missing = keys - set(FairShare.objects.filter(key__in=keys).values_list("key", flat=True))
    FairShare.objects.bulk_create([FairShare(key=key) for key in missing], ignore_conflicts=True)
    return len(missing)


# --- where a job stands -------------------------------------------------------------------------------


def queue_positions(job_ids):
    """Return ``{job id: its 1-based place among all queued jobs in fair_order}`` for those of ``job_ids`` queued.

    One statement, whatever the number of ids: the queue numbered by a window function, then filtered."""
    job_ids = [str(pk) for pk in job_ids]
    if not job_ids:
        return {}
    from django.db.models import Window
    from django.db.models.functions import RowNumber

    numbered = (
        Job.objects.filter(status=JobStatus.QUEUED)
        .annotate(share_usage=share_usage())
        .annotate(position=Window(RowNumber(), order_by=fair_order()))
        .order_by()
        .values("pk", "position")
    )
    sql, params = numbered.query.sql_with_params()
    marks = ", ".join(["%s"] * len(job_ids))
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT q.pk, q.position FROM ({sql}) q WHERE q.pk IN ({marks})", (*params, *job_ids))
        return {pk: position for pk, position in cursor.fetchall()}


# --- charging -------------------------------------------------------------------------------------------


def _uncharged():
    """Attempts holding GPU time not charged yet: running, or ended since their last charge (index attempt_uncharged)."""
    return JobAttempt.objects.filter(started_at__isnull=False).filter(
        Q(finished_at__isnull=True) | Q(charged_until__isnull=True) | Q(charged_until__lt=F("finished_at"))
    )


def fairshare_charge(*, now=None, batch=CHARGE_BATCH):
    """Charge each share the GPU time its attempts held since their last charge (running ones up to ``now``);
    return how many attempts were charged. Set-based, in batches; safe to run twice at once (attempts are taken
    with SKIP LOCKED, shares' rows locked in key order)."""
    now = now or timezone.now()
    total = 0
    while True:
        with transaction.atomic():
            charged = _charge_batch(now=now, batch=batch)
        total += charged
        if charged < batch:
            break
    shares_ensure_queued()
    return total


def _charge_batch(*, now, batch):
    half_life = _half_life()
    attempts = list(
        _uncharged()
        .select_for_update(skip_locked=True, of=("self",))
        .order_by("started_at", "pk")
        .values("pk", "started_at", "finished_at", "charged_until", "gpus", "job__share")[:batch]
    )
    if not attempts:
        return 0
    added, until = {}, {}
    for row in attempts:
        end = min(row["finished_at"] or now, now)
        until[row["pk"]] = end
        seconds = held_seconds(row["started_at"], row["finished_at"], since=row["charged_until"], until=now, now=now)
        if seconds and row["gpus"]:
            share = row["job__share"]
            added[share] = usage_add(added.get(share), seconds * row["gpus"], end, half_life=half_life)
    if added:
        # Rows first (a row another transaction is adding is waited for, not lost), then each locked in key order.
        FairShare.objects.bulk_create([FairShare(key=key) for key in sorted(added)], ignore_conflicts=True)
        held = {
            share.key: share.usage_log
            for share in FairShare.objects.select_for_update().filter(key__in=list(added)).order_by("key")
        }
        update_rows(
            FairShare.objects, {key: {"usage_log": _log_sum(held[key], value), "updated_at": now} for key, value in added.items()}
        )
    update_rows(JobAttempt.objects, {pk: {"charged_until": at} for pk, at in until.items()})
    return len(attempts)


def _log_sum(a, b):
    """log2(2**a + 2**b), either None for nothing."""
    if a is None or b is None:
        return b if a is None else a
    high, low = max(a, b), min(a, b)
    return high + math.log2(1 + 2 ** (low - high))
