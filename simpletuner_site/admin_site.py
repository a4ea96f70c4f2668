"""The operators' admin: a fleet overview on the index, and list pages whose statuses refresh in place.

Its sign-in page is throttled (``simpletuner_site.login``), and the account changes its pages make are
audited as their signed-in user's (``workers.accounts``).

Pages listen to the change feed (``realtime.operator_feed``); a ``changes`` event naming a row on the page, a
reconnect, or a 10-second timer makes ``live.js`` fetch the changed cells from the page's ``live/``
URL, rendered by the same display methods as the list itself.
"""

import functools
from datetime import timedelta

from django.conf import settings
from django.contrib import admin
from django.db.models import Count, Q, Sum
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone

from audit.services import Actor
from common.permissions import may
from job_queue.models import Job, JobStatus
from job_queue.permissions import VIEW_JOBS
from job_queue.selectors import jobs_waiting_reasons
from workers.accounts import acting_as
from workers.models import Worker, WorkerStatus
from workers.permissions import VIEW_WORKERS

from .login import AdminLoginForm, throttled_answer

RECENT_FAILURES = 5
STUCK_SHOWN = 5
QUEUED_TOO_LONG = timedelta(minutes=10)


# --- the site ---------------------------------------------------------------------------------------


def fleet_overview(user):
    """Return what the admin index shows ``user``: workers by status, jobs queued and running, recent failures.

    Each part only for a user who may view those objects (None otherwise).
    """
    overview = {"workers": None, "jobs": None}
    if may(user, VIEW_WORKERS):
        by_status = dict(Worker.objects.order_by().values_list("status").annotate(n=Count("pk")))
        overview["workers"] = {
            "by_status": [(status, label, by_status.get(status, 0)) for status, label in WorkerStatus.choices],
            "total": sum(by_status.values()),
            "gpus": _gpus(),
        }
    if may(user, VIEW_JOBS):
        overview["jobs"] = _job_overview()
    return overview


def _gpus():
    """Return the GPUs of online workers: free (idle, with a stream, not draining) and busy (holding a job)."""
    online = Worker.objects.order_by().filter(status__in=[WorkerStatus.IDLE, WorkerStatus.BUSY, WorkerStatus.DRAINING])
    totals = online.aggregate(
        free=Sum("gpu_count", filter=Q(status=WorkerStatus.IDLE, stream_id__isnull=False, drain_requested_at__isnull=True)),
        busy=Sum("gpu_count", filter=Q(current_job__isnull=False)),
        total=Sum("gpu_count"),
    )
    return {key: value or 0 for key, value in totals.items()}


def stuck_jobs(now=None):
    """Return up to STUCK_SHOWN ``(job, why)`` that look stuck: a dispatch unacknowledged for half the
    acknowledgement timeout, a running job whose worker has been silent for two heartbeats, a job queued
    for ten minutes."""
    return _stuck_jobs(now)[0]


def _stuck_jobs(now=None, also=()):
    """``stuck_jobs``, and the waiting reasons of its queued jobs and of the queued jobs in ``also``, worked out
    from one read of the fleet: ``(found, {job pk: reason})``."""
    now = now or timezone.now()
    config = settings.SIMPLETUNER
    found = []
    unacked = now - timedelta(seconds=config["DISPATCH_ACK_TIMEOUT"] / 2)
    for job in Job.objects.filter(status=JobStatus.DISPATCHED, dispatched_at__lt=unacked).order_by("dispatched_at")[:STUCK_SHOWN]:
        found.append((job, f"dispatched to {job.worker_name} {_ago(now, job.dispatched_at)} ago and not acknowledged"))
    silent = now - timedelta(seconds=2 * config["HEARTBEAT_INTERVAL"])
    # The silent workers' current jobs (by primary key): a join on every job a silent worker ever ran,
    # sorted, took 10-45 ms on SQLite at 10,000 workers and 105,000 jobs; this takes 1.5 ms on either database.
    held_by_silent = Worker.objects.filter(last_heartbeat__lt=silent, current_job__isnull=False).values("current_job_id")
    running = Job.objects.filter(status=JobStatus.RUNNING, pk__in=held_by_silent).select_related("worker")
    for job in running.order_by("started_at")[:STUCK_SHOWN]:
        found.append((job, f"its worker {job.worker_name} has been silent for {_ago(now, job.worker.last_heartbeat)}"))
    waiting = Job.objects.filter(status=JobStatus.QUEUED, submitted_at__lt=now - QUEUED_TOO_LONG).order_by("submitted_at")
    waiting = list(waiting[: max(STUCK_SHOWN - len(found), 0)])
    reasons = jobs_waiting_reasons([*waiting, *also])
    found += [(job, f"queued for {_ago(now, job.submitted_at)}: {reasons[job.pk]}") for job in waiting]
    return found[:STUCK_SHOWN], reasons


def _ago(now, moment):
    seconds = int((now - moment).total_seconds()) if moment else 0
    return f"{seconds // 60} min" if seconds >= 120 else f"{seconds} s"


def _job_overview():
    job_counts = dict(
        Job.objects.order_by()
        .filter(status__in=[JobStatus.QUEUED, JobStatus.DISPATCHED, JobStatus.RUNNING])
        .values_list("status")
        .annotate(n=Count("pk"))
    )
    oldest = Job.objects.filter(status=JobStatus.QUEUED).order_by("-priority", "submitted_at").first()
    stuck, reasons = _stuck_jobs(also=[oldest] if oldest else [])
    return {
        "oldest_waiting": (oldest, reasons[oldest.pk]) if oldest else None,
        "stuck": stuck,
        "queued": job_counts.get(JobStatus.QUEUED, 0),
        "running": job_counts.get(JobStatus.RUNNING, 0) + job_counts.get(JobStatus.DISPATCHED, 0),
        "recent_failures": list(
            Job.objects.filter(status=JobStatus.FAILED)
            .order_by("-finished_at")
            .only("pk", "config_name", "worker_name", "last_error", "finished_at")[:RECENT_FAILURES]
        ),
    }


class OrchestratorAdminSite(admin.AdminSite):
    site_header = "SimpleTuner orchestrator"
    site_title = "SimpleTuner orchestrator"
    index_title = "Fleet"
    login_form = AdminLoginForm

    def login(self, request, extra_context=None):
        """The sign-in page; 429 with ``Retry-After`` once the address or username is past the failed sign-ins' rate."""
        return throttled_answer(super().login(request, extra_context))

    def admin_view(self, view, cacheable=False):
        """Every admin page, with the account changes it makes audited as its signed-in user's (``workers.accounts``)."""

        @functools.wraps(view)
        def acting(request, *args, **kwargs):
            with acting_as(Actor.for_request(request)):
                return view(request, *args, **kwargs)

        return super().admin_view(acting, cacheable)

    def get_urls(self):
        overview = path("live/overview/", self.admin_view(self.overview_view), name="fleet_overview")
        return [overview, *super().get_urls()]

    def _overview_context(self, request):
        return {"overview": fleet_overview(request.user)}

    def index(self, request, extra_context=None):
        return super().index(request, {**self._overview_context(request), **(extra_context or {})})

    def overview_view(self, request):
        """The index's fleet overview alone, for ``live.js`` to swap in."""
        return TemplateResponse(request, "admin/simpletuner/fleet_overview.html", self._overview_context(request))


