"""The operators' admin: a fleet overview on the index, and list pages whose statuses refresh in place.

Pages listen to the change feed (``audit.live``); a ``changes`` event naming a row on the page, a
reconnect, or a 10-second timer makes ``live.js`` fetch the changed cells from the page's ``live/``
URL, rendered by the same display methods as the list itself.
"""

import json
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.db import connections
from django.db.models import Count
from django.http import JsonResponse
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import conditional_escape, format_html, format_html_join

from audit.models import AuditEvent
from job_queue.models import Job, JobStatus
from simpletuner_site.errors import ServiceError
from simpletuner_site.humanize import ago
from workers.models import Worker, WorkerStatus

LIVE_ROWS_MAX = 500
# Above this many rows an unfiltered count on PostgreSQL is the planner's estimate (COUNT(*) reads them all).
ESTIMATE_COUNT_ABOVE = 100_000
RECENT_FAILURES = 5


# --- shared display helpers -------------------------------------------------------------------------


def ago_html(moment):
    """Return an age that ``live.js`` keeps ticking in the browser, with the exact time on hover."""
    if moment is None:
        return format_html('<span class="st-muted">{}</span>', "never")
    local = timezone.localtime(moment)
    return format_html(
        '<time datetime="{}" data-ago title="{}">{}</time>', moment.isoformat(), f"{local:%Y-%m-%d %H:%M:%S %Z}", ago(moment)
    )


def status_badge(status, label=None, *, note=""):
    """Return a coloured status pill (colours in ``static/simpletuner/admin/admin.css``)."""
    return format_html(
        '<span class="st-badge st-{}" data-status="{}">{}</span>{}',
        status,
        status,
        label or status,
        format_html(' <span class="st-muted">{}</span>', note) if note else "",
    )


def admin_link(obj, text=None):
    """Return a link to ``obj``'s admin page."""
    opts = obj._meta
    url = reverse(f"admin:{opts.app_label}_{opts.model_name}_change", args=[quote(obj.pk)])
    return format_html('<a href="{}">{}</a>', url, text or str(obj))


class EstimatedCountPaginator(Paginator):
    """Counts exactly, except an unfiltered list of a large table on PostgreSQL: ``pg_class.reltuples``.

    For the tables that only grow (jobs, the audit trail), whose list would otherwise count every row
    on every page.
    """

    @cached_property
    def count(self):
        queryset = self.object_list
        connection = connections[queryset.db]
        if connection.vendor == "postgresql" and not queryset.query.where:
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT reltuples::bigint FROM pg_class WHERE oid = %s::regclass", [queryset.model._meta.db_table]
                )
                row = cursor.fetchone()
            if row and row[0] > ESTIMATE_COUNT_ABOVE:
                return row[0]
        return super().count


# --- live list pages --------------------------------------------------------------------------------


class LiveChangeListMixin:
    """For a ModelAdmin: ``live_fields`` (display-method names in ``list_display``) refresh in place.

    Adds ``<changelist>/live/?ids=a,b`` answering ``{"rows": {pk: {field: html}}, "missing": [...]}``;
    with ``&detail=1`` the cells of ``live_detail_fields`` too, which the object's own page refreshes.
    """

    live_fields = ()
    live_detail_fields = ()
    change_list_template = "admin/simpletuner/live_change_list.html"  # tells live.js where rows refresh from

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        live = path("live/", self.admin_site.admin_view(self.live_rows_view), name="%s_%s_live" % info)
        return [live, *super().get_urls()]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        info = self.opts.app_label, self.opts.model_name
        live = {"live_object_url": reverse("admin:%s_%s_live" % info), "live_object_id": unquote(object_id)}
        return super().change_view(request, object_id, form_url, {**live, **(extra_context or {})})

    def live_rows_view(self, request):
        """Return the live cells of the rows whose primary keys ``?ids=`` lists (at most 500)."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        ids = [pk for pk in request.GET.get("ids", "").split(",") if pk][:LIVE_ROWS_MAX]
        fields = (*self.live_fields, *self.live_detail_fields) if request.GET.get("detail") else self.live_fields
        queryset = self.get_queryset(request).filter(pk__in=ids)
        if self.list_select_related:  # as the list page does, or one query per row for its links
            queryset = queryset.select_related(*(() if self.list_select_related is True else self.list_select_related))
        rows = {
            # Escaped as the list page escapes them: a plain string (a GPU name an agent reported) is text, not HTML.
            str(obj.pk): {name: str(conditional_escape(getattr(self, name)(obj))) for name in fields}
            for obj in queryset
        }
        return JsonResponse({"rows": rows, "missing": sorted(set(ids) - set(rows)), "now": timezone.now().isoformat()})


class ObjectButtonsMixin:
    """For a ModelAdmin: detail-page buttons, each a POST-only view at ``<object_id>/<name>/``.

    ``object_buttons`` names them; ``<name>_view(request, pk)`` gets the id already unquoted, and runs
    only for a POST by a user with ``has_<button_permission>_permission``. URL names are
    ``<app>_<model>_<name>``.
    """

    object_buttons = ()
    button_permission = "change"

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        buttons = [
            path(f"<str:object_id>/{name}/", self.admin_site.admin_view(self._button_view(name)), name="%s_%s_" % info + name)
            for name in self.object_buttons
        ]
        return [*buttons, *super().get_urls()]

    def _button_view(self, name):
        view = getattr(self, f"{name}_view")
        allowed = getattr(self, f"has_{self.button_permission}_permission")

        def posted(request, object_id):
            if request.method != "POST" or not allowed(request):
                raise PermissionDenied
            return view(request, unquote(object_id))

        return posted

    def change_page(self, pk):
        """Redirect to the admin page of the object ``pk``."""
        info = self.opts.app_label, self.opts.model_name
        return redirect(reverse("admin:%s_%s_change" % info, args=[quote(pk)]))


# --- the site ---------------------------------------------------------------------------------------


def fleet_overview(user):
    """Return what the admin index shows ``user``: workers by status, jobs queued and running, recent failures.

    Each part only for a user who may view those objects (None otherwise).
    """
    overview = {"workers": None, "jobs": None}
    if user.has_perm("workers.view_worker"):
        by_status = dict(Worker.objects.order_by().values_list("status").annotate(n=Count("pk")))
        overview["workers"] = {
            "by_status": [(status, label, by_status.get(status, 0)) for status, label in WorkerStatus.choices],
            "total": sum(by_status.values()),
        }
    if user.has_perm("queue.view_job"):
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


# --- helpers for the apps' admins ---------------------------------------------------------------------


def run_service_on_each(modeladmin, request, objects, call, *, done):
    """Call ``call(obj)`` for each object; report the successes as ``done`` and each refusal by its reason.

    Every admin action goes through the same services as the API, so the audit rows and events match.
    """
    succeeded = []
    for obj in objects:
        try:
            call(obj)
        except ServiceError as exc:
            modeladmin.message_user(request, f"Refused: {exc.detail}", messages.ERROR)
        else:
            succeeded.append(str(getattr(obj, "name", None) or obj.pk))
    if succeeded:
        modeladmin.message_user(request, f"{done}: {', '.join(succeeded)}", messages.SUCCESS)
    return succeeded


def audit_trail_html(target_type, target_id, limit=50):
    """Return the newest audit rows about one worker or job as an HTML table (with a link to all of them)."""
    rows = list(AuditEvent.objects.filter(target_type=target_type, target_id=target_id)[:limit])
    if not rows:
        return format_html('<span class="st-muted">{}</span>', "no audit rows")
    body = format_html_join(
        "",
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><code>{}</code></td></tr>",
        (
            (
                f"{timezone.localtime(row.created_at):%Y-%m-%d %H:%M:%S}",
                row.action,
                f"{row.actor_type}:{row.actor_name or row.actor_id}",
                "yes" if row.success else "refused",
                _short_json(row.details),
            )
            for row in rows
        ),
    )
    everything = reverse("admin:audit_auditevent_changelist") + "?" + urlencode({"q": target_id})
    return format_html(
        '<table class="st-audit"><thead><tr><th>When</th><th>Action</th><th>By</th><th>OK</th><th>Details</th>'
        '</tr></thead><tbody>{}</tbody></table><p><a href="{}">All audit rows for {}</a></p>',
        body,
        everything,
        target_id,
    )


def _short_json(value, limit=300):
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def pretty_json_html(value):
    """Return ``value`` as indented JSON in a ``<pre>``."""
    return format_html("<pre>{}</pre>", json.dumps(value, indent=2, sort_keys=True, default=str))


def form_page(modeladmin, request, form, *, title, intro, form_id, submit_label):
    """Render an admin page holding one form (the Add worker and Submit job pages)."""
    context = {
        **modeladmin.admin_site.each_context(request),
        "title": title,
        "intro": intro,
        "form_id": form_id,
        "submit_label": submit_label,
        "opts": modeladmin.opts,
        "form": form,
        "media": modeladmin.media + form.media,
    }
    return TemplateResponse(request, "admin/simpletuner/form_page.html", context)
