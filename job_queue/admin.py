"""The Jobs page: submit a job from a form, follow it live, cancel or retry it, read its attempts and log.

Every change goes through job_queue.services (the same calls as the API), so audit rows and the
events workers receive are identical whichever way an operator acts.
"""


from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.urls import reverse
from django.utils.html import format_html, format_html_join

from audit.html import audit_trail_html
from audit.services import Actor
from common.admin_kit import (
    EstimatedCountPaginator,
    JSONFormField,
    LiveChangeListMixin,
    ObjectButtonsMixin,
    OperatorPermissionsMixin,
    admin_link,
    ago_html,
    changelist_url,
    confirmation_page,
    confirmed,
    form_page,
    run_service_on_each,
    status_badge,
)
from common.errors import ServiceError
from tenancy.services import priority_check
from training_configs.admin import ConfigSecretsAdminMixin
from workers.admin import LabelPairsField

from . import permissions, worker_admin  # noqa: F401 (worker_admin registers the Workers page)
from .admin_artifacts import artifacts_html, attempt_steps_text
from .admin_configs import stored_config_html
from .charts import progress_bar_html
from .api.serializers import JobSubmitSerializer
from .log_admin import JobLogAdminMixin
from .models import JOB_RETRYABLE, JOB_TERMINAL, Job, JobAttempt, JobStatus, JobTarget
from .fairshare import queue_positions
from .selectors import job_waiting_reason
from .services import job_cancel, job_retry, job_submit


class JobSubmitForm(forms.Form):
    """The API's submission, as a form; validated by the API's own serializer so both accept the same jobs."""

    config_name = forms.CharField(max_length=255, help_text="A name for this training configuration.")
    config = JSONFormField(
        required=False,  # "{}" is empty to a required field; blank or {} means no settings, as in the API
        initial=dict,
        widget=forms.Textarea(attrs={"rows": 12, "cols": 80, "class": "st-json", "spellcheck": "false"}),
        help_text='The trainer\'s configuration as a JSON object, e.g. {"learning_rate": 0.0001, "num_processes": 1}.',
    )
    dataloader = JSONFormField(
        required=False,
        widget=forms.Textarea(attrs={"rows": 4, "cols": 80, "class": "st-json", "spellcheck": "false"}),
        help_text="Optional dataloader configuration: a JSON object or list.",
    )
    target = forms.ChoiceField(choices=JobTarget.choices, initial=JobTarget.WORKER)
    worker_labels = LabelPairsField(
        label="Label selectors",
        placeholder="gpu_type=a100*\nlocation=datacenter-a",
        example="gpu_type=a100*",
        help_text="One KEY=GLOB per line; a worker must match all of them.",
    )
    gpu_count = forms.IntegerField(
        label="GPU count",
        required=False,
        min_value=0,
        help_text="GPUs the job needs; empty means the config's num_processes, else any worker.",
    )
    priority = forms.IntegerField(initial=0, help_text="Higher runs first; ties run first-in first-out.")
    max_retries = forms.IntegerField(
        required=False, min_value=0, help_text="Retries after a lost worker; empty means the orchestrator's default."
    )
    retry_on_failure = forms.BooleanField(required=False, help_text="Also retry when the trainer itself fails.")

    def clean_config(self):
        config = self.cleaned_data["config"]
        if config is None:
            return {}
        if not isinstance(config, dict):
            raise forms.ValidationError("config must be a JSON object ({...})")
        return config

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        serializer = JobSubmitSerializer(data={k: v for k, v in data.items() if v is not None or k == "dataloader"})
        if not serializer.is_valid():
            for field, errors in serializer.errors.items():
                self.add_error(field if field in self.fields else None, [str(e) for e in errors])
            return data
        return serializer.validated_data


class JobAttemptInline(admin.TabularInline):
    model = JobAttempt
    extra = 0
    can_delete = False
    fields = ["number", "worker_link", "gpus_display", "dispatched_at", "started_at", "finished_at", "steps", "outcome", "error"]
    readonly_fields = fields
    verbose_name_plural = "Attempts"

    @admin.display(description="GPUs")
    def gpus_display(self, attempt):
        """The packing worker's GPUs the attempt ran on; the whole worker (its count) otherwise."""
        if attempt.gpu_indices is not None:
            return ",".join(map(str, attempt.gpu_indices))
        return format_html('<span class="st-muted">{}</span>', f"whole worker ({attempt.gpus})")

    @admin.display(description="Steps (from → reached)")
    def steps(self, attempt):
        return attempt_steps_text(attempt)

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("worker")

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    @admin.display(description="Worker")
    def worker_link(self, attempt):
        return admin_link(attempt.worker, attempt.worker_name) if attempt.worker_id else attempt.worker_name


@admin.register(Job)
class JobAdmin(
    ConfigSecretsAdminMixin, JobLogAdminMixin, OperatorPermissionsMixin, ObjectButtonsMixin, LiveChangeListMixin, admin.ModelAdmin
):
    list_display = ["id", "config_name", "status_display", "progress_bar", "worker_display", "attempts", "age", "priority", "team"]  # target: the filter
    live_fields = ("status_display", "progress_bar", "worker_display", "attempts")
    live_detail_fields = ("waiting", "log", "progress_chart")
    list_filter = ["status", "target", "submitted_at", "team"]
    search_fields = ["=id", "config_name", "worker_name"]
    list_select_related = ["worker", "team"]
    list_per_page = 100
    paginator = EstimatedCountPaginator
    show_full_result_count = False  # a filtered page does not count every job a second time
    actions = ["cancel_jobs", "retry_jobs"]
    object_buttons = ("cancel", "retry")
    operator_permissions = {
        "view": permissions.VIEW_JOBS,
        "add": permissions.SUBMIT_JOBS,
        "cancel": permissions.CANCEL_JOBS,
        "retry": permissions.RETRY_JOBS,
    }  # and no delete: jobs are history; no change: jobs change only through submit, cancel and retry
    inlines = [JobAttemptInline]
    change_form_template = "admin/queue/job/change_form.html"
    fieldsets = [
        ("Status", {"fields": ["id", "status_display", "queue_position", "waiting", "progress_bar", "progress_chart", "worker_display", "attempts", "last_error", "exit_code"]}),
        ("Log tail", {"fields": ["log", "full_log_link"]}),
        ("Artifacts", {"fields": ["artifacts_display"]}),
        ("Settings", {"fields": ["config_name", "stored_config", "config_display", "dataloader_display", "target", "labels", "gpu_count", "priority", "max_retries", "retry_on_failure", "retry_links"]}),
        ("Timing", {"fields": ["submitted_at", "submitted_by", "team", "dispatched_at", "started_at", "finished_at"]}),
        ("Audit trail", {"fields": ["audit_trail"]}),
    ]
    readonly_fields = [
        "id", "status_display", "queue_position", "waiting", "progress_bar", "progress_chart", "worker_display", "attempts", "last_error", "exit_code", "log",
        "full_log_link", "config_name", "config_display", "dataloader_display", "target", "labels", "gpu_count", "priority",
        "max_retries", "retry_on_failure", "retry_links", "submitted_at", "submitted_by", "team", "dispatched_at",
        "started_at", "finished_at", "audit_trail", "artifacts_display", "stored_config", "config_revealed", "dataloader_revealed",
    ]  # fmt: skip

    @admin.display(description="Stored config")
    def stored_config(self, job):
        return stored_config_html(job)

    @admin.display(description="Files")
    def artifacts_display(self, job):
        return artifacts_html(job)  # each link checks the download permission itself

    # --- permissions: one per action (operator_permissions), as in the API -------------------------

    def has_cancel_permission(self, request):
        return self.may(request, "cancel")

    def has_retry_permission(self, request):
        return self.may(request, "retry")

    def get_queryset(self, request):
        jobs = super().get_queryset(request)
        match = request.resolver_match
        if match is not None and match.url_name in ("queue_job_changelist", "queue_job_live"):
            jobs = jobs.defer("config", "dataloader", "log_tail")  # up to 16 KB of log a row, unused by lists
        return jobs

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    # --- columns -----------------------------------------------------------------------------------

    @admin.display(description="Status", ordering="status")
    def status_display(self, job):
        note = f"retry {job.retry_count} of {job.max_retries}" if job.retry_count and job.status not in JOB_TERMINAL else ""
        return status_badge(job.status, job.get_status_display(), note=note)

    @admin.display(description="Progress")
    def progress_bar(self, job):
        return progress_bar_html(job)

    @admin.display(description="Worker", ordering="worker_name")
    def worker_display(self, job):
        if job.worker_id and job.gpu_indices is not None:  # on a packing worker's GPUs
            gpus = ",".join(map(str, job.gpu_indices))
            return format_html('{} <span class="st-muted">GPUs {}</span>', admin_link(job.worker, job.worker.name), gpus)
        if job.worker_id:
            return admin_link(job.worker, job.worker.name)
        return job.worker_name or format_html('<span class="st-muted">{}</span>', "—")

    @admin.display(description="Attempts", ordering="attempt_count")
    def attempts(self, job):
        retries = f" ({job.retry_count} retr{'y' if job.retry_count == 1 else 'ies'})" if job.retry_count else ""
        return f"{job.attempt_count}{retries}"

    @admin.display(description="Age", ordering="submitted_at")
    def age(self, job):
        return ago_html(job.submitted_at)

    @admin.display(description="Place in the queue")
    def queue_position(self, job):
        """The job's place in the order the dispatcher offers queued jobs in (priority, fair share, age)."""
        return (queue_positions([job.pk]).get(job.pk) if job.status == JobStatus.QUEUED else None) or "—"

    @admin.display(description="Why it waits")
    def waiting(self, job):
        return job_waiting_reason(job) or "—"

    @admin.display(description="Last lines of output")
    def log(self, job):
        if not job.log_tail:
            return format_html('<span class="st-muted">{}</span>', "no output yet")
        return format_html('<pre class="st-log">{}</pre>', job.log_tail)

    @admin.display(description="Label selectors")
    def labels(self, job):
        return format_html_join(" ", '<span class="st-label">{}={}</span>', sorted(job.worker_labels.items())) or "—"

    @admin.display(description="Retries")
    def retry_links(self, job):
        parts = []
        if job.retry_of_id:
            parts.append(format_html("Retry of {}", admin_link(job.retry_of, job.retry_of_id)))
        retried_as = list(job.retries.order_by("submitted_at").values_list("pk", flat=True))
        if retried_as:
            links = format_html_join(", ", '<a href="{}">{}</a>', ((reverse("admin:queue_job_change", args=[quote(pk)]), pk) for pk in retried_as))
            parts.append(format_html("Retried as {}", links))
        return format_html_join(" · ", "{}", ((part,) for part in parts)) or "—"

    @admin.display(description="Audit trail")
    def audit_trail(self, job):
        return audit_trail_html("job", job.pk)

    # --- submit ------------------------------------------------------------------------------------

    def add_view(self, request, form_url="", extra_context=None):
        if not self.has_add_permission(request):
            raise PermissionDenied
        initial = {"max_retries": settings.SIMPLETUNER["JOB_MAX_RETRIES"], "config": {}}
        form = JobSubmitForm(request.POST or None, initial=initial)
        if request.method == "POST" and form.is_valid():
            try:
                priority_check(user=request.user, priority=form.cleaned_data.get("priority"))
                job, dispatched = job_submit(**form.cleaned_data, actor=Actor.for_request(request))
            except ServiceError as exc:
                form.add_error(None, exc.detail)
            else:
                self._say_where(request, job, dispatched, "Submitted")
                return self.change_page(job.pk)
        return form_page(
            self,
            request,
            form,
            title="Submit a training job",
            intro="Queues a training job; it is dispatched at once when a matching worker is idle. "
            "The API takes the same fields (POST /api/queue/submit).",
            form_id="job_submit_form",
            submit_label="Submit job",
        )

    def _say_where(self, request, job, dispatched, verb):
        if dispatched:
            self.message_user(request, f"{verb} {job.pk}: dispatched to {job.worker_name}.", messages.SUCCESS)
        else:
            self.message_user(request, f"{verb} {job.pk}: queued; {job_waiting_reason(job)}.", messages.SUCCESS)

    # --- cancel and retry ----------------------------------------------------------------------------

    # --- cancel and retry: each lists what will change and asks first ------------------------------

    @admin.action(description="Cancel selected jobs (a running one is told to stop)", permissions=["cancel"])
    def cancel_jobs(self, request, queryset):
        jobs = list(queryset.select_related("worker"))
        if not confirmed(request):
            return self._confirm(request, jobs, "cancel", action="cancel_jobs", back_url=changelist_url(self))
        run_service_on_each(
            self, request, jobs, lambda j: job_cancel(job_id=j.pk, actor=Actor.for_request(request)), done="Cancelled"
        )
        return None

    @admin.action(description="Retry selected failed or cancelled jobs (as new jobs)", permissions=["retry"])
    def retry_jobs(self, request, queryset):
        jobs = list(queryset)
        if not confirmed(request):
            return self._confirm(request, jobs, "retry", action="retry_jobs", back_url=changelist_url(self))
        new_jobs = []
        run_service_on_each(
            self,
            request,
            jobs,
            lambda j: new_jobs.append(job_retry(job_id=j.pk, actor=Actor.for_request(request))[0]),
            done="Retried",
        )
        if new_jobs:
            self.message_user(request, "New jobs: " + ", ".join(job.pk for job in new_jobs), messages.INFO)
        return None

    def _confirm(self, request, jobs, what, *, back_url, action=None):
        rows, refused = [], []
        for job in jobs:
            changes, why_not = (cancel_changes if what == "cancel" else retry_changes)(job)
            if changes:
                rows.append((f"{job.pk} ({job.config_name})", changes))
            else:
                refused.append((f"{job.pk} ({job.config_name})", why_not))
        return confirmation_page(
            self,
            request,
            title="Cancel jobs" if what == "cancel" else "Retry jobs",
            question="Cancel these jobs?" if what == "cancel" else "Retry these jobs, each as a new job with the same settings?",
            rows=rows,
            refused=refused,
            confirm_label="Yes, cancel them" if what == "cancel" else "Yes, retry them",
            back_url=back_url,
            action=action,
            objects=[job for job in jobs if (cancel_changes if what == "cancel" else retry_changes)(job)[0]],
        )

    def cancel_view(self, request, job_id):
        if not confirmed(request):
            job = self.get_object(request, job_id)
            if job is not None:
                return self._confirm(request, [job], "cancel", back_url=reverse("admin:queue_job_change", args=[quote(job.pk)]))
        try:
            job_cancel(job_id=job_id, actor=Actor.for_request(request))
        except ServiceError as exc:
            self.message_user(request, f"Refused: {exc.detail}", messages.ERROR)
        else:
            self.message_user(request, f"Cancelled {job_id}.", messages.SUCCESS)
        return self.change_page(job_id)

    def retry_view(self, request, job_id):
        if not confirmed(request):
            job = self.get_object(request, job_id)
            if job is not None:
                return self._confirm(request, [job], "retry", back_url=reverse("admin:queue_job_change", args=[quote(job.pk)]))
        try:
            job, dispatched = job_retry(job_id=job_id, actor=Actor.for_request(request))
        except ServiceError as exc:
            self.message_user(request, f"Refused: {exc.detail}", messages.ERROR)
            return self.change_page(job_id)
        self._say_where(request, job, dispatched, f"Retried {job_id} as")
        return self.change_page(job.pk)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        job = self.get_object(request, unquote(object_id))
        extra = {
            "can_cancel": job is not None and job.status not in JOB_TERMINAL and self.has_cancel_permission(request),
            "can_retry": job is not None and job.status in JOB_RETRYABLE and self.has_retry_permission(request),
        }
        return super().change_view(request, object_id, form_url, {**extra, **(extra_context or {})})


def cancel_changes(job):
    """Return ``(what cancelling job changes, why it cannot)`` for its confirmation page (one of them empty)."""
    if job.status in JOB_TERMINAL:
        return [], f"already {job.status}: nothing to cancel"
    changes = [f"status {job.status} → cancelled"]
    if job.worker_id:
        changes.append(
            f"worker {job.worker_name} is told to stop it (job_cancel); it stays busy until its agent confirms the trainer stopped"
        )
    else:
        changes.append("it leaves the queue; no worker runs it")
    return changes, ""


def retry_changes(job):
    """Return ``(what retrying job changes, why it cannot)`` for its confirmation page (one of them empty)."""
    if job.status not in JOB_RETRYABLE:
        return [], f"{job.status}: only a failed or cancelled job can be retried"
    return [
        f"a new job with the same settings is queued (retry_of {job.pk}) and dispatched when a matching worker is free",
        f"this one stays {job.status}, as it was",
    ], ""
