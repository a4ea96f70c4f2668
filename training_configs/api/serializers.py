"""Request and response shapes of the configs API."""

from rest_framework import serializers

from common.fields import BoundedJSON, BoundedText
from common.serializers import ModelSerializer, Serializer

from ..models import NAME_MAX_CHARS, NAME_PATTERN, TrainingConfig
from ..secrets import config_shown, may_view_secrets


class ConfigShown(serializers.JSONField):
    """A config or dataloader as the requesting user may read it: the values of secret keys masked
    (``training_configs.secrets``) unless the user may view secrets, or when no request is known."""

    def to_representation(self, value):
        request = self.context.get("request")
        reveal = request is not None and may_view_secrets(request.user)
        return config_shown(super().to_representation(value), reveal=reveal)


class ConfigCreateSerializer(Serializer):
    name = BoundedText(max_length=NAME_MAX_CHARS, schema_pattern=NAME_PATTERN, trim_whitespace=False)  # checked by the service
    config = BoundedJSON(types=(dict,))
    dataloader = BoundedJSON(types=(dict, list), required=False, allow_null=True, default=None)
    description = BoundedText(max_length=10_000, required=False, allow_blank=True, default="")


class ConfigVersionSerializer(ModelSerializer):
    config = ConfigShown(read_only=True, help_text="The trainer's config (a JSON object); secret keys' values masked without configs.view_config_secrets.")
    dataloader = ConfigShown(read_only=True, allow_null=True, help_text="The dataloader config (a JSON object or list), if any; masked alike.")
    owner = serializers.SerializerMethodField()
    immutable = serializers.BooleanField(read_only=True, help_text="A job used it: editing makes a new version.")

    class Meta:
        model = TrainingConfig
        fields = ["name", "version", "config", "dataloader", "description", "owner", "created_at", "used_at", "immutable"]
        read_only_fields = fields

    def get_owner(self, config) -> str | None:
        return config.owner.get_username() if config.owner_id and config.owner else None


class ConfigSummarySerializer(ConfigVersionSerializer):
    """A config in the list: its latest version, without the bodies."""

    class Meta(ConfigVersionSerializer.Meta):
        fields = ["name", "version", "description", "owner", "created_at", "used_at", "immutable"]
        read_only_fields = fields


class ConfigDetailSerializer(Serializer):
    name = serializers.CharField()
    latest = serializers.IntegerField()
    versions = ConfigVersionSerializer(many=True)
