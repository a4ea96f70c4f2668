"""The Workers page's actions that reach a worker's job: rotating its token (registered as the Workers page).

``workers.admin.WorkerAdmin`` holds the page; rotating a busy worker's token ends its job, which only
``job_queue.fleet`` may do, so the rotate action and button live here, in a subclass registered in its place.
"""

from django.contrib import admin, messages
from django.contrib.admin.utils import quote
from django.urls import reverse

from audit.services import Actor
from common.admin_kit import changelist_url, confirmation_page, confirmed
from common.errors import ServiceError
from workers import permissions as worker_permissions
from workers.admin import WorkerAdmin
from workers.models import Worker

from .fleet import worker_rotate_token
from .models import JOB_ACTIVE

JOB_FIELD = "job"  # the confirmation page re-posts the running job it named


class FleetWorkerAdmin(WorkerAdmin):
    actions = [*WorkerAdmin.actions, "rotate_token"]
    object_buttons = (*WorkerAdmin.object_buttons, "rotate")
    operator_permissions = {**WorkerAdmin.operator_permissions, "rotate": worker_permissions.ROTATE_WORKER_TOKENS}

    def has_rotate_permission(self, request):
        return self.may(request, "rotate")

    @admin.action(description="Rotate the token of the selected worker (shown once)", permissions=["rotate"])
    def rotate_token(self, request, queryset):
        workers = list(queryset[:2])
        if len(workers) != 1:
            self.message_user(request, "Select exactly one worker to rotate its token.", messages.WARNING)
            return None
        return self._rotate(request, workers[0], action="rotate_token", back_url=changelist_url(self))

    def rotate_view(self, request, worker_id):
        worker = self._worker_or_404(request, worker_id)
        back_url = reverse("admin:workers_worker_change", args=[quote(worker.pk)])
        return self._rotate(request, worker, back_url=back_url) or self.change_page(worker.pk)

    def _rotate(self, request, worker, *, back_url, action=None):
        """Show what rotating ``worker``'s token changes; once confirmed, rotate it and show the new token once."""
        job = worker.current_job if worker.current_job_id else None
        job = job if job is not None and job.status in JOB_ACTIVE else None
        if not confirmed(request):
            return confirmation_page(
                self,
                request,
                title=f"Rotate the token of {worker.name}",
                question=f"Rotate the token of worker {worker.name}?"
                + (f" It is running job {job.pk} ({job.config_name})." if job else ""),
                rows=[(str(worker), rotation_changes(worker, job))],
                confirm_label="Yes, rotate its token" + (f" and stop job {job.pk}" if job else ""),
                back_url=back_url,
                action=action,
                objects=[worker],
                hidden=[(JOB_FIELD, job.pk if job else "")],
            )
        shown = request.POST.get(JOB_FIELD) or None
        try:
            token, _job_id = worker_rotate_token(
                worker_id=worker.pk, actor=Actor.for_request(request), force=shown is not None, confirmed_job=shown
            )
        except ServiceError as exc:
            self.message_user(request, f"Refused: {exc.detail}", messages.ERROR)
            return None
        return self._token_page(request, worker, token, "has a new token")


def rotation_changes(worker, job):
    """Return what rotating ``worker``'s token changes, ``job`` being the job it runs (or None)."""
    active = [t.prefix for t in worker.tokens.all() if t.is_active]
    streams = len(worker.open_streams or ()) or int(worker.stream_id is not None)
    changes = [
        f"its token ({', '.join(p + '…' for p in active) or 'none active'}) is refused from now on; "
        "a new one is shown once, on the next page",
        f"its {streams} open stream(s) are closed; its agent stops and must be restarted with the new token",
    ]
    if job is not None:
        changes.append(
            f"job {job.pk} ({job.config_name}, {job.status}) is stopped and goes back to the queue "
            "without spending a retry; the worker goes offline until its agent comes back"
        )
    return changes


admin.site.unregister(Worker)  # workers.admin registered the page without the rotate action
admin.site.register(Worker, FleetWorkerAdmin)
