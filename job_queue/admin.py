"""Django admin for jobs (read-only here; submission and cancellation go through job_queue.services)."""

from django.contrib import admin

from .models import Job, JobAttempt


class JobAttemptInline(admin.TabularInline):
    model = JobAttempt
    extra = 0
    can_delete = False
    readonly_fields = [f.name for f in JobAttempt._meta.fields]


@admin.register(Job)
class JobAdmin(admin.ModelAdmin):
    list_display = ["id", "config_name", "status", "target", "priority", "worker_name", "attempt_count", "submitted_at"]
    list_filter = ["status", "target"]
    search_fields = ["id", "config_name", "worker_name"]
    readonly_fields = [f.name for f in Job._meta.fields]
    inlines = [JobAttemptInline]

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False
