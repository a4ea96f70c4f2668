"""Read-only audit log in the Django admin."""

from django.contrib import admin

from .models import AuditEvent


@admin.register(AuditEvent)
class AuditEventAdmin(admin.ModelAdmin):
    list_display = ["created_at", "action", "actor_type", "actor_name", "target_type", "target_id", "success", "client_ip"]
    list_filter = ["action", "actor_type", "success"]
    search_fields = ["target_id", "actor_name"]
    date_hierarchy = "created_at"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
