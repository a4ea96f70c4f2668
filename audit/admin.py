"""The audit log in the Django admin: read-only for everyone, superusers included.

Built for a trail of millions of rows: the filters offer fixed choices (no DISTINCT scan of the
table per page), and an unfiltered page on PostgreSQL counts with the planner's estimate.
"""

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html

from common.admin_kit import EstimatedCountPaginator, ReadOnlyAdminMixin, pretty_json_html

from . import actions
from .models import AuditEvent

# Where a target's own admin page is, by target_type.
TARGET_PAGES = {"worker": "admin:workers_worker_change", "job": "admin:queue_job_change"}
TARGET_TYPES = ("worker", "job", "user")


def target_html(event):
    """Return ``event``'s target as ``type:id``, linked to the target's admin page where it has one."""
    if not event.target_id:
        return event.target_type or "—"
    label = f"{event.target_type}:{event.target_id}"
    page = TARGET_PAGES.get(event.target_type)
    if page is None:
        return label
    try:
        url = reverse(page, args=[quote(event.target_id)])
    except NoReverseMatch:
        return label
    return format_html('<a href="{}">{}</a>', url, label)


def _choices_filter(field, title, values):
    """Return a list filter on ``field`` offering ``values`` as they are, without reading the table."""

    class ChoicesFilter(admin.SimpleListFilter):
        parameter_name = field

        def lookups(self, request, model_admin):
            return [(value, value) for value in values]

        def queryset(self, request, queryset):
            return queryset.filter(**{field: self.value()}) if self.value() else queryset

    ChoicesFilter.title = title
    return ChoicesFilter


ActionFilter = _choices_filter(
    "action", "action", sorted(v for k, v in vars(actions).items() if k.isupper() and isinstance(v, str))
)
TargetTypeFilter = _choices_filter("target_type", "target type", TARGET_TYPES)


@admin.register(AuditEvent)
class AuditEventAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["created_at", "action", "actor", "target", "success", "client_ip"]
    list_filter = [ActionFilter, "actor_type", "success", "created_at", TargetTypeFilter]
    paginator = EstimatedCountPaginator
    search_fields = ["target_id"]  # see get_search_results
    search_help_text = "Search by the exact id of a worker or job (e.g. w_1a2b3c4d5e6f, j_…)."
    list_per_page = 100
    show_full_result_count = False  # a filtered page does not count the whole trail a second time
    fields = ["created_at", "action", "success", "actor_type", "actor_id", "actor_name", "client_ip", "target", "details_display"]
    readonly_fields = fields

    def get_search_results(self, request, queryset, search_term):
        # Exact and case-sensitive, so the target_id index serves it (Django's "=field" is iexact: a full scan).
        term = search_term.strip()
        return (queryset.filter(target_id=term) if term else queryset), False

    @admin.display(description="By", ordering="actor_name")
    def actor(self, event):
        return f"{event.actor_type}: {event.actor_name or event.actor_id or '—'}"

    @admin.display(description="Target", ordering="target_id")
    def target(self, event):
        return target_html(event)

    @admin.display(description="Details")
    def details_display(self, event):
        return pretty_json_html(event.details)

