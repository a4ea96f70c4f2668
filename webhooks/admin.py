"""The Webhooks pages: webhooks (their secret write-only), their deliveries with each attempt, and redelivery.

Every change goes through ``webhooks.services`` (the same calls as the API), each checking its own permission.
"""

import json

from django import forms
from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.urls import reverse
from django.utils.html import format_html

from audit.html import audit_trail_html
from audit.services import Actor
from common.admin_kit import (
    ObjectButtonsMixin,
    OperatorPermissionsMixin,
    admin_link,
    ago_html,
    changelist_url,
    confirmation_page,
    confirmed,
    pretty_json_html,
    run_service_on_each,
    status_badge,
)
from common.errors import ServiceError

from . import permissions, services
from .models import EVENTS, Delivery, DeliveryAttempt, DeliveryStatus, Webhook, WebhookFormat

SECRET_HELP = "Signs each delivery (HMAC-SHA256). Never shown again; leave empty to keep the current one."


class WebhookForm(forms.ModelForm):
    """A webhook's form, checked by the service's own rules (URL and its addresses, events, secret)."""

    events = forms.MultipleChoiceField(choices=[(e, e) for e in EVENTS], widget=forms.CheckboxSelectMultiple)
    secret = forms.CharField(required=False, strip=False, widget=forms.PasswordInput(render_value=False), help_text=SECRET_HELP)

    class Meta:
        model = Webhook
        fields = ["url", "events", "secret", "format", "active"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.initial.pop("secret", None)  # write-only: the stored one never reaches the page
        if self.instance.pk is None:
            self.fields["secret"].help_text = "Signs each delivery (HMAC-SHA256); required unless the format is Slack. Never shown again."

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        changes = {k: data[k] for k in ("url", "events", "format") if k in data}
        if data.get("secret"):
            changes["secret"] = data["secret"]
        elif self.instance.pk is None and data.get("format") != WebhookFormat.SLACK:
            self.add_error("secret", "Required: it signs every delivery.")
            return data
        try:
            services.webhook_check(**changes)
        except ServiceError as exc:
            for field, reasons in exc.extra.get("errors", {}).items():
                self.add_error(field if field in self.fields else None, reasons)
        return data


@admin.register(Webhook)
class WebhookAdmin(OperatorPermissionsMixin, admin.ModelAdmin):
    form = WebhookForm
    list_display = ["id", "url", "events_display", "format", "active", "pending"]
    list_filter = ["active", "format"]
    search_fields = ["=id", "url"]
    operator_permissions = {
        "view": permissions.VIEW_WEBHOOKS,
        "add": permissions.ADD_WEBHOOKS,
        "change": permissions.CHANGE_WEBHOOKS,
        "delete": permissions.DELETE_WEBHOOKS,
    }
    readonly_fields = ["id", "created_by", "created_at", "updated_at", "deliveries_link", "audit_trail"]

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["url", "events", "secret", "format", "active"]
        return ["id", "url", "events", "secret", "format", "active", "created_by", "created_at", "updated_at", "deliveries_link", "audit_trail"]

    def has_change_permission(self, request, obj=None):
        return self.may(request, "change")

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)  # deletion goes through the service, one at a time, from its page
        return actions

    @admin.display(description="Events")
    def events_display(self, hook):
        return ", ".join(hook.events)

    @admin.display(description="Pending deliveries")
    def pending(self, hook):
        return hook.deliveries.filter(status=DeliveryStatus.PENDING).count()

    @admin.display(description="Deliveries")
    def deliveries_link(self, hook):
        url = reverse("admin:webhooks_delivery_changelist") + f"?webhook__id__exact={hook.pk}"
        return format_html('<a href="{}">{}</a>', url, "Its deliveries and their attempts")

    @admin.display(description="Audit trail")
    def audit_trail(self, hook):
        return audit_trail_html("webhook", hook.pk)

    def save_model(self, request, obj, form, change):
        data = form.cleaned_data
        actor = Actor.for_request(request)
        fields = {k: data[k] for k in ("url", "events", "format", "active")}
        if data.get("secret"):
            fields["secret"] = data["secret"]
        saved = services.webhook_update(webhook_id=obj.pk, actor=actor, **fields) if change else services.webhook_create(actor=actor, **fields)
        obj.pk = saved.pk

    def get_deleted_objects(self, objs, request):
        """The delete page lists each webhook with the number of its deliveries (deleted with it, under the webhook's
        own delete permission), not every delivery."""
        rows = [f"{hook} and its {hook.deliveries.count()} deliveries, with their attempts" for hook in objs]
        return rows, {"webhooks": len(objs)}, set(), []

    def delete_model(self, request, obj):
        services.webhook_delete(webhook_id=obj.pk, actor=Actor.for_request(request))


class DeliveryAttemptInline(admin.TabularInline):
    model = DeliveryAttempt
    extra = 0
    can_delete = False
    fields = ["number", "started_at", "duration_ms", "status_code", "outcome", "error"]
    readonly_fields = fields
    verbose_name_plural = "Attempts"

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(Delivery)
class DeliveryAdmin(OperatorPermissionsMixin, ObjectButtonsMixin, admin.ModelAdmin):
    list_display = ["delivery_id", "event", "subject", "status_display", "tries", "answer", "occurred", "next_attempt"]
    list_filter = ["status", "event", "webhook"]
    search_fields = ["=delivery_id", "=subject"]
    list_select_related = ["webhook"]
    actions = ["redeliver_deliveries"]
    object_buttons = ("redeliver",)
    operator_permissions = {"view": permissions.VIEW_WEBHOOKS, "redeliver": permissions.REDELIVER_WEBHOOKS}
    inlines = [DeliveryAttemptInline]
    change_form_template = "admin/webhooks/delivery/change_form.html"
    fields = [
        "delivery_id", "webhook_link", "event", "subject", "status_display", "attempts", "last_status_code", "last_error",
        "occurred_at", "next_attempt_at", "retry_until", "finished_at", "body_display",
    ]  # fmt: skip
    readonly_fields = fields

    def has_add_permission(self, request):
        return False

    def has_delete_permission(self, request, obj=None):
        return False  # deliveries are history; deleting the webhook deletes them

    def has_redeliver_permission(self, request):
        return self.may(request, "redeliver")

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra = {"can_redeliver": self.has_redeliver_permission(request), **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra)

    def get_actions(self, request):
        actions = super().get_actions(request)
        actions.pop("delete_selected", None)
        return actions

    @admin.display(description="Webhook", ordering="webhook")
    def webhook_link(self, delivery):
        return admin_link(delivery.webhook, delivery.webhook_id)

    @admin.display(description="Status", ordering="status")
    def status_display(self, delivery):
        return status_badge(delivery.status, delivery.get_status_display())

    @admin.display(description="Tries", ordering="attempts")
    def tries(self, delivery):
        return delivery.attempts

    @admin.display(description="Answer", ordering="last_status_code")
    def answer(self, delivery):
        return delivery.last_status_code or ("error" if delivery.last_error else "—")

    @admin.display(description="Occurred", ordering="occurred_at")
    def occurred(self, delivery):
        return ago_html(delivery.occurred_at)

    @admin.display(description="Next try", ordering="next_attempt_at")
    def next_attempt(self, delivery):
        return ago_html(delivery.next_attempt_at) if delivery.status == DeliveryStatus.PENDING else "—"

    @admin.display(description="Body (as sent and signed)")
    def body_display(self, delivery):
        return pretty_json_html(json.loads(delivery.body))

    @admin.action(description="Redeliver selected deliveries (same id and body)", permissions=["redeliver"])
    def redeliver_deliveries(self, request, queryset):
        deliveries = list(queryset)
        if not confirmed(request):
            return self._confirm(request, deliveries, action="redeliver_deliveries", back_url=changelist_url(self))
        actor = Actor.for_request(request)
        run_service_on_each(
            self, request, deliveries, lambda d: services.delivery_redeliver(delivery_id=d.delivery_id, actor=actor), done="Redelivering"
        )
        return None

    def redeliver_view(self, request, pk):
        delivery = Delivery.objects.filter(pk=pk).first()
        if delivery is None:
            raise PermissionDenied
        if not confirmed(request):
            return self._confirm(request, [delivery], back_url=reverse("admin:webhooks_delivery_change", args=[pk]))
        actor = Actor.for_request(request)
        run_service_on_each(
            self, request, [delivery], lambda d: services.delivery_redeliver(delivery_id=d.delivery_id, actor=actor), done="Redelivering"
        )
        return self.change_page(pk)

    def _confirm(self, request, deliveries, *, back_url, action=None):
        rows = [(d.delivery_id, [f"{d.event} of {d.subject}: {d.status} → pending, sent again"]) for d in deliveries if d.status != DeliveryStatus.PENDING]
        refused = [(d.delivery_id, "pending already: it is being sent or retried") for d in deliveries if d.status == DeliveryStatus.PENDING]
        return confirmation_page(
            self,
            request,
            title="Redeliver",
            question="Send these deliveries again, with the same id and body?",
            rows=rows,
            refused=refused,
            confirm_label="Yes, redeliver",
            back_url=back_url,
            action=action,
            objects=[d for d in deliveries if d.status != DeliveryStatus.PENDING],
        )
