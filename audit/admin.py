"""The audit log in the Django admin: read-only for everyone, superusers included."""

from django.contrib import admin
from django.contrib.admin.utils import quote
from django.urls import NoReverseMatch, reverse
from django.utils.html import format_html

from simpletuner_site.admin_site import pretty_json_html

from .models import AuditEvent

# Where a target's own admin page is, by target_type.
TARGET_PAGES = {"worker": "admin:workers_worker_change", "job": "admin:queue_job_change"}


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "action", "actor", "target", "success", "client_ip"]
    list_filter = ["action", "actor_type", "success", "created_at", "target_type"]
    search_fields = ["=target_id"]
    search_help_text = "Search by the exact id of a worker or job (e.g. w_1a2b3c4d5e6f, j_…)."
    date_hierarchy = "created_at"
    list_per_page = 100
    show_full_result_count = False  # a filtered page does not count the whole trail a second time
    fields = ["created_at", "action", "success", "actor_type", "actor_id", "actor_name", "client_ip", "target", "details_display"]
    readonly_fields = fields

    @admin.display(description="By", ordering="actor_name")
    def actor(self, event):
        return f"{event.actor_type}: {event.actor_name or event.actor_id or '—'}"

    @admin.display(description="Target", ordering="target_id")
    def target(self, event):
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

    @admin.display(description="Details")
    def details_display(self, event):
        return pretty_json_html(event.details)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
