"""Request and response shapes of the webhooks API. A webhook's secret is write-only: no response holds it."""

from rest_framework import serializers

from common.fields import BoundedText, StrictBoolean
from common.serializers import ModelSerializer, Serializer

from ..models import EVENTS, SECRET_MAX_CHARS, URL_MAX_CHARS, Delivery, DeliveryAttempt, Webhook, WebhookFormat


class WebhookWriteSerializer(Serializer):
    url = BoundedText(max_length=URL_MAX_CHARS, help_text="http:// or https://; private addresses refused unless allowed.")
    events = serializers.ListField(child=serializers.ChoiceField(choices=EVENTS), allow_empty=False, min_length=1, max_length=len(EVENTS))
    secret = BoundedText(
        max_length=SECRET_MAX_CHARS, required=False, write_only=True,
        help_text="Signs each body (X-SimpleTuner-Signature); required unless format is slack. Never shown again.",
    )  # fmt: skip
    format = serializers.ChoiceField(choices=WebhookFormat.choices, required=False, default=WebhookFormat.JSON)
    active = StrictBoolean(required=False, default=True)


class WebhookUpdateSerializer(WebhookWriteSerializer):
    """A PATCH: any of the fields, the others kept."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, partial=True, **kwargs)


class WebhookSerializer(ModelSerializer):
    created_by = serializers.SerializerMethodField()

    class Meta:
        model = Webhook
        fields = ["id", "url", "events", "format", "active", "created_by", "created_at", "updated_at"]
        read_only_fields = fields

    def get_created_by(self, hook) -> str | None:
        return hook.created_by.get_username() if hook.created_by_id and hook.created_by else None


class DeliveryAttemptSerializer(ModelSerializer):
    class Meta:
        model = DeliveryAttempt
        fields = ["number", "started_at", "duration_ms", "status_code", "error", "outcome"]
        read_only_fields = fields


class DeliverySerializer(ModelSerializer):
    id = serializers.CharField(source="delivery_id", read_only=True, help_text="X-SimpleTuner-Delivery; the body's id.")
    attempt_history = DeliveryAttemptSerializer(source="attempt_rows", many=True, read_only=True)

    class Meta:
        model = Delivery
        fields = [
            "id", "event", "subject", "occurred_at", "status", "attempts", "next_attempt_at", "last_status_code",
            "last_error", "created_at", "finished_at", "attempt_history",
        ]  # fmt: skip
        read_only_fields = fields
