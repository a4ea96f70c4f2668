"""Django admin for workers and tokens (read-mostly; every change goes through workers.services)."""

from django.contrib import admin

from .models import Token, Worker


@admin.register(Worker)
class WorkerAdmin(admin.ModelAdmin):
    list_display = ["name", "id", "status", "worker_type", "gpu_count", "gpu_name", "current_job", "last_heartbeat"]
    list_filter = ["status", "worker_type"]
    search_fields = ["name", "id", "hostname"]
    readonly_fields = [f.name for f in Worker._meta.fields]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


@admin.register(Token)
class TokenAdmin(admin.ModelAdmin):
    list_display = ["prefix", "kind", "worker", "user", "created_at", "last_used_at", "revoked_at"]
    list_filter = ["kind"]
    readonly_fields = ["kind", "prefix", "worker", "user", "description", "created_at", "last_used_at", "revoked_at"]
    exclude = ["digest"]

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False
