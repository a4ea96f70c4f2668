"""The Workers page's base: the fleet with live statuses; add a worker (token shown once), drain, delete.

Nothing here writes a worker: every action calls the same service as the API (workers.services),
so the audit rows and the events an agent receives are identical whichever way an operator acts.
Each action first shows what it will change and asks for confirmation. ``WorkerAdmin`` is not
registered here: rotating a token, undraining and editing labels reach the worker's job or the queue,
which only ``job_queue`` may touch, so ``job_queue.worker_admin`` subclasses it and registers the page
(once). This module registers the Tokens page only.
"""

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db.models.fields.json import KeyTransform
from django.http import Http404
from django.shortcuts import redirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.timezone import localtime

from audit.html import audit_trail_html
from audit.services import Actor
from common.admin_kit import (
    LiveChangeListMixin,
    ObjectButtonsMixin,
    OperatorPermissionsMixin,
    admin_link,
    ago_html,
    changelist_url,
    confirmation_page,
    confirmed,
    form_page,
    pretty_json_html,
    run_service_on_each,
    status_badge,
)
from common.errors import InvalidInput, ServiceError
from common.inputs import format_controls_shown

from . import permissions
from . import token_admin  # noqa: F401 (registers the Tokens page)
from .models import Worker, WorkerStatus, WorkerType
from .selectors import held_jobs
from .onboarding import CREATABLE_TYPES, agent_command_line, parse_label_pairs
from .streams import serving_entry
from .services import (
    worker_create,
    worker_delete,
    worker_delete_refusal,
    worker_drain,
)

LABEL_CHOICES_MAX = 200


def _reported(field, description):
    """A column showing the text the agent reported in ``field``, with its format controls escaped
    (``common.inputs.format_controls_shown``): registrations are never refused for them."""

    @admin.display(description=description, ordering=field)
    def column(self, worker):
        return format_controls_shown(getattr(worker, field))

    return column


LABEL_VALUES_PER_KEY = 20  # so one high-cardinality key (host=...) cannot crowd the others out


class LabelFilter(admin.SimpleListFilter):
    """Filter by one ``key=value`` label, offered from the labels the listed workers carry."""

    title = "label"
    parameter_name = "label"

    def lookups(self, request, model_admin):
        values = {}
        for labels in model_admin.get_queryset(request).order_by().values_list("labels", flat=True).distinct():
            for key, value in (labels or {}).items():
                values.setdefault(key, set()).add(value)
        pairs = [f"{key}={value}" for key in sorted(values) for value in sorted(values[key])[:LABEL_VALUES_PER_KEY]]
        return [(pair, pair) for pair in pairs[:LABEL_CHOICES_MAX]]

    def queryset(self, request, queryset):
        if not self.value():
            return queryset
        key, _, value = self.value().partition("=")
        return queryset.alias(_label=KeyTransform(key, "labels")).filter(_label=value)


class LabelPairsField(forms.CharField):
    """A textarea of ``KEY=VALUE`` lines (blank ones skipped), cleaned to ``{key: value}`` by the label rules
    (``workers.onboarding.parse_label_pairs``); a malformed or repeated line is the field's error."""

    def __init__(self, *, placeholder, example="gpu=a100", rows=3, cols=40, **kwargs):
        self.example = example
        widget = forms.Textarea(attrs={"rows": rows, "cols": cols, "placeholder": placeholder})
        super().__init__(required=False, widget=widget, **kwargs)

    def clean(self, value):
        try:
            return parse_label_pairs(super().clean(value).splitlines(), example=self.example)
        except InvalidInput as exc:
            raise forms.ValidationError(exc.detail) from None


class WorkerAddForm(forms.Form):
    name = forms.CharField(max_length=128, help_text="Unique; the agent registers with it (--name).")
    worker_type = forms.ChoiceField(
        label="Type",
        choices=[(t, WorkerType(t).label) for t in CREATABLE_TYPES],
        initial=WorkerType.PERSISTENT,
        widget=forms.RadioSelect,
        help_text="Persistent: stays online between jobs (on-prem GPUs). Ephemeral: runs one job, then leaves (spot instances).",
    )
    labels = LabelPairsField(
        placeholder="gpu_type=a100\nlocation=datacenter-a", help_text="One KEY=VALUE per line. Jobs choose workers by their labels."
    )


class WorkerAdmin(OperatorPermissionsMixin, ObjectButtonsMixin, LiveChangeListMixin, admin.ModelAdmin):
    list_display = ["name", "status_display", "worker_type", "gpus", "labels_display", "current_job_display", "heartbeat"]
    live_fields = ("status_display", "gpus", "current_job_display", "heartbeat")
    live_detail_fields = ("metrics_display",)
    list_filter = ["status", "worker_type", LabelFilter]
    search_fields = ["name", "=id", "hostname", "gpu_name"]
    list_select_related = ["current_job"]
    list_per_page = 100
    actions = ["drain_workers", "delete_workers"]
    object_buttons = ("drain",)
    operator_permissions = {
        "view": permissions.VIEW_WORKERS,
        "add": permissions.CREATE_WORKERS,
        "drain": permissions.DRAIN_WORKERS,
        "delete": permissions.DELETE_WORKERS,
    }
    change_form_template = "admin/workers/worker/change_form.html"
    fieldsets = [
        (None, {"fields": ["id", "name", "status_display", "worker_type", "labels_display", "current_job_display"]}),
        ("Machine", {"fields": ["hostname_shown", "agent_version_shown", "agent_display", "gpus", "accelerator_shown", "gpu_info_display", "metrics_display"]}),
        ("Connection", {"fields": ["heartbeat", "serving_agent_display", "connected_at", "stream_opened_at", "status_changed_at", "drain_requested_at", "tokens_display"]}),
        ("History", {"fields": ["created_at", "created_by", "recent_jobs", "audit_trail"]}),
    ]
    readonly_fields = [
        "id", "name", "status_display", "worker_type", "labels_display", "current_job_display", "hostname_shown",
        "agent_version_shown", "agent_display", "gpus", "accelerator_shown", "gpu_info_display", "metrics_display", "heartbeat",
        "serving_agent_display", "connected_at", "stream_opened_at", "status_changed_at", "drain_requested_at", "tokens_display",
        "created_at", "created_by", "recent_jobs", "audit_trail",
    ]  # fmt: skip

    # --- permissions: one per action (operator_permissions); fields change only through the actions ---

    def has_drain_permission(self, request):
        return self.may(request, "drain")

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # ours goes through worker_delete
        return actions

    # --- columns ---------------------------------------------------------------------------------

    @admin.display(description="Status", ordering="status")
    def status_display(self, worker):
        note = "drain requested" if worker.is_draining and worker.status != WorkerStatus.DRAINING else ""
        if worker.status == WorkerStatus.IDLE and not worker.has_stream:
            note = "no open stream"
        elif not note and worker.agent_name and worker.agent_name != worker.name:
            note = f"agent calls itself {format_controls_shown(worker.agent_name)}"
        return status_badge(worker.status, worker.get_status_display(), note=note)

    @admin.display(description="GPUs", ordering="gpu_count")
    def gpus(self, worker):
        if not worker.gpu_count:
            return format_html('<span class="st-muted">{}</span>', worker.accelerator_type or "none")
        vram = f" · {worker.gpu_vram_gb:g} GB" if worker.gpu_vram_gb else ""
        # A packing worker (several jobs at once): how many of its GPUs a new job may take now.
        free = f" · {worker.gpus_free} free, up to {worker.max_jobs} jobs" if worker.packs else ""
        return format_html("{}× {}{}{}", worker.gpu_count, format_controls_shown(worker.gpu_name or "GPU"), vram, free)  # the agent names it

    @admin.display(description="Labels")
    def labels_display(self, worker):
        if not worker.labels:
            return format_html('<span class="st-muted">{}</span>', "none")
        return format_html_join(
            "", '<span class="st-label">{}={}</span>', sorted((worker.labels or {}).items())
        )

    @admin.display(description="Current job")
    def current_job_display(self, worker):
        if worker.packs and worker.status in (WorkerStatus.BUSY, WorkerStatus.DRAINING):
            # Its jobs and gang members and the GPUs each holds (workers.selectors.held_jobs).
            jobs = held_jobs(worker)  # one read per busy packing worker shown (a page holds 100 rows at most)
            return format_html_join(
                mark_safe("<br>"),
                "{} <span class=\"st-muted\">GPUs {}</span>",
                ((admin_link(job, job.config_name), ",".join(map(str, job.gpu_indices))) for job in jobs),
            ) or format_html('<span class="st-muted">{}</span>', "—")
        if worker.current_job is None:
            return format_html('<span class="st-muted">{}</span>', "—")
        return admin_link(worker.current_job, worker.current_job.config_name)

    @admin.display(description="Last heartbeat", ordering="last_heartbeat")
    def heartbeat(self, worker):
        return ago_html(worker.last_heartbeat)

    @admin.display(description="Agent says")
    def agent_display(self, worker):
        if not worker.agent_name and worker.agent_persistent is None:
            return format_html('<span class="st-muted">{}</span>', "nothing yet (not registered)")
        said = format_html(
            "name {} · {}",
            format_controls_shown(worker.agent_name or "—"),
            "unknown type" if worker.agent_persistent is None else ("persistent" if worker.agent_persistent else "ephemeral"),
        )
        notes = worker.agent_notes()
        if not notes:
            return said
        return format_html(
            '{}{}', said, format_html_join("", '<div class="st-warning st-agent-note">{}</div>', ((format_controls_shown(n),) for n in notes))
        )

    @admin.display(description="Serving agent")
    def serving_agent_display(self, worker):
        entry = serving_entry(worker)
        if entry is None:
            return format_html('<span class="st-muted">{}</span>', "none (no open stream)")
        instance = entry.get("instance")
        return format_html(
            "{} on {} · {}",
            format_controls_shown(entry.get("name") or "—"),
            format_controls_shown(entry.get("host") or "unknown host"),
            f"instance {instance[:12]}" if instance else "sends no instance (SimpleTuner's released agent?)",
        )

    hostname_shown = _reported("hostname", "Hostname")
    agent_version_shown = _reported("agent_version", "Agent version")
    accelerator_shown = _reported("accelerator_type", "Accelerator type")

    @admin.display(description="GPU info")
    def gpu_info_display(self, worker):
        return pretty_json_html(worker.gpu_info)

    @admin.display(description="Latest utilisation")
    def metrics_display(self, worker):
        return pretty_json_html(worker.metrics)

    @admin.display(description="Tokens")
    def tokens_display(self, worker):
        tokens = worker.tokens.order_by("-created_at")
        return format_html_join(
            "",
            "<div><code>{}…</code> {} (created {})</div>",
            ((t.prefix, "active" if t.is_active else "revoked", f"{localtime(t.created_at):%Y-%m-%d %H:%M}") for t in tokens),
        )

    @admin.display(description="Recent jobs")
    def recent_jobs(self, worker):
        jobs = worker.jobs.order_by("-submitted_at")[:10]
        if not jobs:
            return format_html('<span class="st-muted">{}</span>', "none")
        return format_html_join(
            "", "<div>{} {}</div>", ((status_badge(job.status), admin_link(job, job.config_name)) for job in jobs)
        )

    @admin.display(description="Audit trail")
    def audit_trail(self, worker):
        return audit_trail_html("worker", worker.pk)

    # --- add: the token and the agent's command line are shown once -------------------------------

    def add_view(self, request, form_url="", extra_context=None):
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = WorkerAddForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            try:
                worker, token = worker_create(**form.cleaned_data, actor=Actor.for_request(request))
            except ServiceError as exc:
                form.add_error("name" if exc.code == "name_taken" else None, exc.detail)
            else:
                return self._token_page(request, worker, token, "created")
        return form_page(
            self,
            request,
            form,
            title="Add worker",
            intro="Creates the worker and its token. The token is shown once, on the next page, "
            "with the command that starts the agent on the GPU machine.",
            form_id="worker_add_form",
            submit_label="Create worker",
        )

    def _token_page(self, request, worker, token, what):
        orchestrator_url = request.build_absolute_uri("/").rstrip("/")
        context = {
            **self.admin_site.each_context(request),
            "title": f"Worker {worker.name} {what}",
            "opts": self.opts,
            "worker": worker,
            "what": what,
            "token": token,
            "command": agent_command_line(worker=worker, token=token, orchestrator_url=orchestrator_url),
        }
        response = TemplateResponse(request, "admin/workers/worker/token_once.html", context)
        response["Cache-Control"] = "no-store"  # the token must not come back from a cache or history
        return response

    # --- actions (list) and buttons (detail page): each asks for confirmation first ---------------

    @admin.action(description="Drain selected workers (finish the current job, take no new one)", permissions=["drain"])
    def drain_workers(self, request, queryset):
        workers = list(queryset.select_related("current_job"))
        if not confirmed(request):
            return self._confirm_drain(request, workers, action="drain_workers", back_url=changelist_url(self))
        run_service_on_each(
            self, request, workers, lambda w: worker_drain(worker_id=w.pk, actor=Actor.for_request(request)), done="Draining"
        )
        return None

    @admin.action(description="Delete selected workers (offline ones only)", permissions=["delete"])
    def delete_workers(self, request, queryset):
        workers = list(queryset)
        if not confirmed(request):
            rows, refused = [], []
            for worker in workers:
                refusal = worker_delete_refusal(worker)
                if refusal:
                    refused.append((str(worker), refusal))
                else:
                    rows.append((str(worker), delete_changes(worker)))
            return confirmation_page(
                self,
                request,
                title="Delete workers",
                question="Delete these workers? Only offline (or never connected) workers can be deleted.",
                rows=rows,
                refused=refused,
                confirm_label="Yes, delete them",
                back_url=changelist_url(self),
                action="delete_workers",
                objects=[w for w in workers if not worker_delete_refusal(w)],
            )
        run_service_on_each(
            self, request, workers, lambda w: worker_delete(worker_id=w.pk, actor=Actor.for_request(request)), done="Deleted"
        )
        return None

    def _confirm_drain(self, request, workers, *, action=None, back_url):
        rows, refused = [], []
        for worker in workers:
            changes = drain_changes(worker)
            if changes:
                rows.append((str(worker), changes))
            else:
                refused.append((str(worker), "already draining: nothing changes"))
        return confirmation_page(
            self,
            request,
            title="Drain workers" if action else f"Drain {workers[0].name}",
            question="Drain? A draining worker finishes its current job and takes no new one, until it is put back in service.",
            rows=rows,
            refused=refused,
            confirm_label="Yes, drain",
            back_url=back_url,
            action=action,
            objects=workers,
        )

    def _worker_or_404(self, request, worker_id):
        worker = self.get_object(request, worker_id)
        if worker is None:
            raise Http404(f"worker {worker_id} does not exist")
        return worker

    def drain_view(self, request, worker_id):
        worker = self._worker_or_404(request, worker_id)
        if not confirmed(request):
            return self._confirm_drain(request, [worker], back_url=reverse("admin:workers_worker_change", args=[quote(worker.pk)]))
        run_service_on_each(
            self, request, [worker], lambda w: worker_drain(worker_id=w.pk, actor=Actor.for_request(request)), done="Draining"
        )
        return self.change_page(worker.pk)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        buttons = {f"can_{action}": self.may(request, action) for action in ("drain", "rotate", "delete")}
        return super().change_view(request, object_id, form_url, {**buttons, **(extra_context or {})})

    def get_deleted_objects(self, objs, request):
        # worker_delete removes the worker's tokens with it: workers.delete_worker is the whole permission
        # (Django would otherwise ask for workers.delete_token and refuse an operator the confirmation).
        deleted, counts, _perms_needed, protected = super().get_deleted_objects(objs, request)
        return deleted, counts, set(), protected

    def delete_model(self, request, obj):
        worker_delete(worker_id=obj.pk, actor=Actor.for_request(request))  # never a bare ORM delete

    def delete_view(self, request, object_id, extra_context=None):
        worker = self.get_object(request, unquote(object_id))
        if worker is not None and self.has_delete_permission(request, worker):
            refusal = worker_delete_refusal(worker)
            if refusal:
                self.message_user(request, f"Refused: {refusal}", messages.ERROR)
                return self.change_page(worker.pk)
            if request.method == "POST":
                try:
                    worker_delete(worker_id=worker.pk, actor=Actor.for_request(request))
                except ServiceError as exc:
                    self.message_user(request, f"Refused: {exc.detail}", messages.ERROR)
                    return self.change_page(worker.pk)
                self.message_user(request, f"Deleted worker {worker.name}; its jobs and audit trail are kept.", messages.SUCCESS)
                return redirect(reverse("admin:workers_worker_changelist"))
        return super().delete_view(request, object_id, extra_context)


def drain_changes(worker):
    """Return what draining ``worker`` changes, for its confirmation; empty when it drains already."""
    if worker.is_draining:
        return []
    job = worker.current_job
    changes = [f"status {worker.status} → draining" if worker.status != WorkerStatus.OFFLINE else "it comes back draining"]
    if job is not None:
        changes.append(f"it finishes its current job {job.pk} ({job.config_name}), then takes no new one")
    else:
        changes.append("it takes no new job")
    changes.append("its agent is sent a drain event (an ephemeral agent then leaves)")
    return changes


def delete_changes(worker):
    """Return what deleting ``worker`` changes, for its confirmation."""
    tokens = worker.tokens.count()
    return [
        f"the worker and its {tokens} token(s) are deleted",
        "its jobs, their attempts and the audit trail are kept (they keep its name)",
    ]
