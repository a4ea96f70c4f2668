"""The admin's usage pages: GPU usage by user, team or config (filters, a weekly bar chart, CSV), who is near their
GPU-hour quota, and each team's usage on the Teams pages (``tenancy.admin.TeamAdmin`` with its usage added)."""

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html

from common.errors import InvalidInput
from common.permissions import may
from job_queue.usage import GROUPS, QUOTA_WINDOW, usage_by_week, usage_rows
from tenancy import permissions
from tenancy.admin import TeamAdmin
from tenancy.models import LimitScope, Limits, Team

from .usage import usage_csv, usage_query, weekly_chart_html

NEAR_QUOTA = 0.8  # the share of a quota from which the page marks it


def quota_standing(*, now=None):
    """Return ``[{"scope", "name", "quota_hours", "used_hours", "share"}]``: every GPU-hour quota set, with its usage
    over the last 30 days, most used share first."""
    now = now or timezone.now()
    since = now - QUOTA_WINDOW
    quotas = list(Limits.objects.filter(gpu_hours_per_30_days__isnull=False).select_related("team", "user"))
    if not quotas:
        return []
    used = {
        scope: {row["key"]: row["gpu_seconds"] for row in usage_rows(group_by=scope, since=since, until=now, now=now)}
        for scope in ("user", "team")
    }
    total = sum(used["user"].values())
    standing = []
    for row in quotas:
        if row.scope == LimitScope.GLOBAL:
            name, seconds = "the fleet", total
        elif row.scope == LimitScope.TEAM:
            name, seconds = row.team.name, used["team"].get(row.team.name, 0.0)
        else:
            name, seconds = row.user.get_username(), used["user"].get(row.user.get_username(), 0.0)
        quota = row.gpu_hours_per_30_days
        share = (seconds / 3600) / quota if quota else 1.0  # a quota of 0 is used up from the start
        standing.append({"scope": row.scope, "name": name, "quota_hours": quota, "used_hours": seconds / 3600, "share": share})
    return sorted(standing, key=lambda s: -s["share"])


class TeamUsageAdmin(TeamAdmin):
    """Teams with their GPU usage of the last 30 days, and the usage page (``usage/``)."""

    list_display = [*TeamAdmin.list_display, "usage_30_days"]
    change_list_template = "admin/observability/team_change_list.html"
    readonly_fields = ["usage_detail"]

    def get_fieldsets(self, request, obj=None):
        fieldsets = super().get_fieldsets(request, obj)
        return [*fieldsets, ("Usage", {"fields": ["usage_detail"]})] if obj is not None else fieldsets

    @admin.display(description="GPU-hours, last 30 days")
    def usage_detail(self, team):
        now = timezone.now()
        rows = usage_rows(group_by="user", since=now - QUOTA_WINDOW, until=now, now=now, team=team)
        total = sum(row["gpu_seconds"] for row in rows) / 3600
        by_member = ", ".join(f"{row['key'] or '(gone)'} {row['gpu_seconds'] / 3600:.2f}" for row in rows)
        link = reverse("admin:tenancy_team_usage") + "?group_by=team"
        return format_html('{} GPU-hours{} · <a href="{}">usage page</a>', f"{total:.2f}", f" ({by_member})" if by_member else "", link)

    def get_urls(self):
        usage = path("usage/", self.admin_site.admin_view(self.usage_view), name="tenancy_team_usage")
        return [usage, *super().get_urls()]

    def changelist_view(self, request, extra_context=None):
        now = timezone.now()
        self._usage = {
            row["key"]: row["gpu_seconds"]
            for row in usage_rows(group_by="team", since=now - QUOTA_WINDOW, until=now, now=now)
        }
        return super().changelist_view(request, {"usage_url": reverse("admin:tenancy_team_usage"), **(extra_context or {})})

    @admin.display(description="GPU-hours, last 30 days")
    def usage_30_days(self, team):
        return f"{getattr(self, '_usage', {}).get(team.name, 0.0) / 3600:.2f}"

    def usage_view(self, request):
        """The usage table (group by, since, until), its weekly chart, ``?format=csv``, and who is near their quota."""
        if not may(request.user, permissions.VIEW_USAGE):
            raise PermissionDenied
        try:
            group_by, since, until, mine = usage_query(request.GET, request.user)
        except InvalidInput as exc:
            return HttpResponse(exc.detail, status=400, content_type="text/plain; charset=utf-8")
        rows = usage_rows(group_by=group_by, since=since, until=until, submitted_by=mine)
        if request.GET.get("format") == "csv":
            response = HttpResponse(usage_csv(rows), content_type="text/csv; charset=utf-8")
            response["Content-Disposition"] = f'attachment; filename="gpu-usage-by-{group_by}.csv"'
            return response
        weeks = usage_by_week(since=since, until=until, submitted_by=mine)
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "GPU usage",
            "rows": [{**row, "gpu_hours": row["gpu_seconds"] / 3600} for row in rows],
            "group_by": group_by,
            "groups": list(GROUPS),
            "since": since,
            "until": until,
            "since_given": request.GET.get("since", ""),
            "until_given": request.GET.get("until", ""),
            "only_mine": mine is not None,
            "chart": weekly_chart_html(weeks),
            "csv_query": request.GET.urlencode(),
            "standing": [s for s in quota_standing()] if mine is None else [],
            "near": NEAR_QUOTA,
        }
        return TemplateResponse(request, "admin/observability/usage.html", context)


admin.site.unregister(Team)
admin.site.register(Team, TeamUsageAdmin)
