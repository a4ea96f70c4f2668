"""The artifact store in the admin: read-only lists (files change only by upload and the retention sweep)."""

from django.contrib import admin

from common.admin_kit import ReadOnlyAdminMixin

from .models import Artifact, Checkpoint


class ReadOnlyAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    pass


@admin.register(Artifact)
class ArtifactAdmin(ReadOnlyAdmin):
    list_display = ["job_id", "key", "size", "sha256", "attempt_number", "checkpoint_step", "updated_at"]
    search_fields = ["=job_id", "key"]
    list_filter = ["updated_at"]


@admin.register(Checkpoint)
class CheckpointAdmin(ReadOnlyAdmin):
    list_display = ["job_id", "step", "attempt_number", "last_upload_at", "completed_at"]
    search_fields = ["=job_id"]
