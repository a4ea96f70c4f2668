"""The operators' admin: a fleet overview on the index, and list pages whose statuses refresh in place.

Pages listen to the change feed (``realtime.operator_feed``); a ``changes`` event naming a row on the page, a
reconnect, or a 10-second timer makes ``live.js`` fetch the changed cells from the page's ``live/``
URL, rendered by the same display methods as the list itself.
"""

from django.contrib import admin
from django.db.models import Count
from django.template.response import TemplateResponse
from django.urls import path

from common.permissions import may
from job_queue.models import Job, JobStatus
from job_queue.permissions import VIEW_JOBS
from workers.models import Worker, WorkerStatus
from workers.permissions import VIEW_WORKERS

RECENT_FAILURES = 5


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
        }
    if may(user, VIEW_JOBS):
        overview["jobs"] = _job_overview()
    return overview


def _job_overview():
    job_counts = dict(
        Job.objects.order_by()
        .filter(status__in=[JobStatus.QUEUED, JobStatus.DISPATCHED, JobStatus.RUNNING])
        .values_list("status")
        .annotate(n=Count("pk"))
    )
    return {
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


