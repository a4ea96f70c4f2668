"""The job page's whole log (a page that follows it live, and a download: ``job_queue.logs``) and its progress chart."""

from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from .charts import progress_chart_html
from .logs import job_full_log, log_limit
from .models import JOB_TERMINAL

LIVE_REFRESH_MS = 3000


class JobLogAdminMixin:
    """For the JobAdmin: ``<id>/log/`` shows the whole log (re-read every few seconds while the job runs),
    ``?raw=1`` gives it as text, ``?download=1`` as a file. Who may view the job may read its log."""

    def get_urls(self):
        view = self.admin_site.admin_view(self.full_log_view)
        return [path("<str:object_id>/log/", view, name="queue_job_log"), *super().get_urls()]

    def full_log_view(self, request, object_id):
        if not self.has_view_permission(request):
            raise PermissionDenied
        job = self.get_object(request, unquote(object_id))
        if job is None:
            raise Http404(f"job {unquote(object_id)} does not exist")
        text = job_full_log(job)
        if request.GET.get("raw") or request.GET.get("download"):
            response = HttpResponse(text, content_type="text/plain; charset=utf-8")
            if request.GET.get("download"):
                response["Content-Disposition"] = f'attachment; filename="{job.pk}.log"'
            response["X-Job-Finished"] = "1" if job.status in JOB_TERMINAL else "0"
            return response
        context = {
            **self.admin_site.each_context(request),
            "title": f"Log of {job.pk} ({job.config_name})",
            "opts": self.opts,
            "job": job,
            "text": text,
            "limit": log_limit(),
            "live": job.status not in JOB_TERMINAL,
            "refresh_ms": LIVE_REFRESH_MS,
        }
        return TemplateResponse(request, "admin/queue/job/full_log.html", context)

    def full_log_link(self, job):
        url = reverse("admin:queue_job_log", args=[quote(job.pk)])
        return format_html(
            '<a href="{}" id="full-log-link">Whole log{}</a> · <a href="{}?download=1" id="full-log-download">download</a>',
            url,
            " (live)" if job.status not in JOB_TERMINAL else "",
            url,
        )

    full_log_link.short_description = "Whole log"

    def progress_chart(self, job):
        """Step and loss over time for the job's latest attempt (refreshed live with the page)."""
        attempt = job.attempts.order_by("-number").only("progress_samples").first()
        return progress_chart_html(attempt.progress_samples if attempt else [])

    progress_chart.short_description = "Progress over time"
