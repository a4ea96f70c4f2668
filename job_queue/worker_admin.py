"""The Workers page, registered here (once): ``workers.admin.WorkerAdmin`` plus the actions that reach a
worker's job or the queue: rotating its token, putting it back in service after a drain, editing its labels.

These actions end a job or offer queued jobs, which only ``job_queue.fleet`` may do; ``workers`` sits
below ``job_queue`` and cannot import it, so the page is completed and registered in this layer.
"""

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import quote
from django.urls import reverse

from audit.services import Actor
from common.admin_kit import changelist_url, confirmation_page, confirmed, form_page, run_service_on_each
from common.errors import ServiceError
from workers import permissions as worker_permissions
from workers.admin import LabelPairsField, WorkerAdmin
from workers.models import Worker, WorkerStatus

from .fleet import worker_rotate_token, worker_set_labels, worker_undrain
from .models import JOB_ACTIVE

JOB_FIELD = "job"  # the confirmation page re-posts the running job it named


class WorkerLabelsForm(forms.Form):
    labels = LabelPairsField(
        placeholder="gpu_type=a100\nlocation=datacenter-a",
        rows=6,
        cols=50,
        help_text="One KEY=VALUE per line; they replace the worker's labels. Queued jobs are matched again at once.",
    )


@admin.register(Worker)
class FleetWorkerAdmin(WorkerAdmin):
    actions = [*WorkerAdmin.actions, "undrain_workers", "rotate_token"]
    object_buttons = (*WorkerAdmin.object_buttons, "undrain", "rotate", "labels")
    operator_permissions = {
        **WorkerAdmin.operator_permissions,
        "undrain": worker_permissions.DRAIN_WORKERS,
        "rotate": worker_permissions.ROTATE_WORKER_TOKENS,
        "labels": worker_permissions.CHANGE_WORKER_LABELS,
    }

    def has_undrain_permission(self, request):
        return self.may(request, "undrain")

    def has_rotate_permission(self, request):
        return self.may(request, "rotate")

    def has_labels_permission(self, request):
        return self.may(request, "labels")

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra = {"can_undrain": self.may(request, "undrain"), "can_labels": self.may(request, "labels")}
        return super().change_view(request, object_id, form_url, {**extra, **(extra_context or {})})

    # --- undrain: back in service --------------------------------------------------------------

    @admin.action(description="Put selected drained workers back in service (undrain)", permissions=["undrain"])
    def undrain_workers(self, request, queryset):
        workers = list(queryset)
        if not confirmed(request):
            return self._confirm_undrain(request, workers, action="undrain_workers", back_url=changelist_url(self))
        run_service_on_each(
            self, request, [w for w in workers if w.is_draining], lambda w: worker_undrain(worker_id=w.pk, actor=Actor.for_request(request)), done="Back in service"
        )
        return None

    def undrain_view(self, request, worker_id):
        worker = self._worker_or_404(request, worker_id)
        if not confirmed(request):
            return self._confirm_undrain(request, [worker], back_url=_change_url(worker))
        run_service_on_each(
            self, request, [worker], lambda w: worker_undrain(worker_id=w.pk, actor=Actor.for_request(request)), done="Back in service"
        )
        return self.change_page(worker.pk)

    def _confirm_undrain(self, request, workers, *, back_url, action=None):
        rows = [(str(w), undrain_changes(w)) for w in workers if w.is_draining]
        return confirmation_page(
            self,
            request,
            title="Put workers back in service",
            question="Put these workers back in service? They take jobs again; queued jobs that match are offered to them at once.",
            rows=rows,
            refused=[(str(w), "not draining: nothing changes") for w in workers if not w.is_draining],
            confirm_label="Yes, put them back in service",
            back_url=back_url,
            action=action,
            objects=[w for w in workers if w.is_draining],
        )

    # --- labels ------------------------------------------------------------------------------------

    def labels_view(self, request, worker_id):
        """The "Edit labels" button: the first POST shows the form; its submission (``post=yes``) saves."""
        worker = self._worker_or_404(request, worker_id)
        current = "\n".join(f"{key}={value}" for key, value in sorted((worker.labels or {}).items()))
        form = WorkerLabelsForm(request.POST if confirmed(request) else None, initial={"labels": current})
        if confirmed(request) and form.is_valid():
            try:
                worker = worker_set_labels(worker_id=worker.pk, labels=form.cleaned_data["labels"], actor=Actor.for_request(request))
            except ServiceError as exc:
                form.add_error("labels", exc.detail)
            else:
                shown = ", ".join(f"{k}={v}" for k, v in sorted(worker.labels.items())) or "none"
                self.message_user(request, f"Labels of {worker.name}: {shown}. Queued jobs were matched again.", messages.SUCCESS)
                return self.change_page(worker.pk)
        form.fields["post"] = forms.CharField(widget=forms.HiddenInput, initial="yes", required=False)
        return form_page(
            self,
            request,
            form,
            title=f"Edit the labels of {worker.name}",
            intro="Jobs choose workers by their labels. The new labels replace the old ones and are audited; "
            "queued jobs are matched again at once (an idle worker may get one).",
            form_id="worker_labels_form",
            submit_label="Save labels",
        )

    @admin.action(description="Rotate the token of the selected worker (shown once)", permissions=["rotate"])
    def rotate_token(self, request, queryset):
        workers = list(queryset[:2])
        if len(workers) != 1:
            self.message_user(request, "Select exactly one worker to rotate its token.", messages.WARNING)
            return None
        return self._rotate(request, workers[0], action="rotate_token", back_url=changelist_url(self))

    def rotate_view(self, request, worker_id):
        worker = self._worker_or_404(request, worker_id)
        return self._rotate(request, worker, back_url=_change_url(worker)) or self.change_page(worker.pk)

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


def _change_url(worker):
    return reverse("admin:workers_worker_change", args=[quote(worker.pk)])


def undrain_changes(worker):
    """Return what putting the draining ``worker`` back in service changes, for its confirmation."""
    if worker.status == WorkerStatus.DRAINING:
        after = "busy (its current job goes on)" if worker.current_job_id else "idle"
        changes = [f"status draining → {after}", "it takes jobs again: a matching queued job may be dispatched to it at once"]
    else:
        changes = [f"it stays {worker.status}; it comes back in service (not draining) when its agent returns"]
    return changes


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

