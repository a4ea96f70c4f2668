"""Stored configs in the admin: JSON checked on save by the API's own rules, a readable diff against the previous
version, a used version never changed in place (saving it makes the next version), and secrets masked for
readers without ``configs.view_config_secrets``."""

import difflib
import json

from django import forms
from django.contrib import admin, messages
from django.utils.html import format_html, format_html_join

from audit.services import Actor
from common.admin_kit import JSONFormField, pretty_json_html
from common.errors import ServiceError

from . import services
from .api.serializers import ConfigCreateSerializer
from .models import TrainingConfig
from .secrets import config_shown, config_unmasked, may_view_secrets
from .selectors import config_previous


def _json_widget(rows):
    return forms.Textarea(attrs={"rows": rows, "cols": 80, "class": "st-json", "spellcheck": "false"})


class TrainingConfigForm(forms.ModelForm):
    """A config version's form. Its JSON is held to the API's rules (``ConfigCreateSerializer``: no NaN or
    infinity, no NUL or unpaired surrogate, the depth and size limits), each refusal a form error. Unless
    ``reveal`` (the user may view secrets), an existing version's secret values are shown masked, and a
    secret left masked keeps its stored value on save."""

    reveal = False  # set per request by TrainingConfigAdmin.get_form
    config = JSONFormField(required=False, widget=_json_widget(16), help_text="The trainer's config (a JSON object).")
    dataloader = JSONFormField(required=False, widget=_json_widget(6), help_text="The dataloader config (a JSON object or list), if any.")

    class Meta:
        model = TrainingConfig
        fields = ["name", "config", "dataloader", "description"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None and not self.reveal:
            for field in ("config", "dataloader"):
                self.initial[field] = config_shown(getattr(self.instance, field), reveal=False)

    def clean_name(self):
        name = self.cleaned_data["name"]
        try:
            services.check_name(name)
        except ServiceError as exc:
            raise forms.ValidationError(exc.detail) from None
        return name

    def clean_config(self):
        value = self._unmasked("config")
        if not isinstance(value, dict):
            raise forms.ValidationError("The config must be a JSON object ({...}).")
        return value

    def clean_dataloader(self):
        value = self._unmasked("dataloader")
        if value is not None and not isinstance(value, (dict, list)):
            raise forms.ValidationError("The dataloader must be a JSON object or list, or empty.")
        return value

    def _unmasked(self, field):
        value = self.cleaned_data.get(field)
        if self.instance.pk is None or self.reveal:
            return value
        return config_unmasked(value, getattr(self.instance, field))

    def clean(self):
        data = super().clean()
        if self.errors:
            return data
        name = data["name"] if "name" in data else self.instance.name  # read-only once stored
        serializer = ConfigCreateSerializer(data={**{k: data.get(k) for k in ("config", "dataloader", "description")}, "name": name})
        if not serializer.is_valid():
            for field, errors in serializer.errors.items():
                self.add_error(field if field in self.fields else None, [str(error) for error in errors])
        return data


def _pretty(config, reveal):
    shown = {"config": config.config, "dataloader": config.dataloader, "description": config.description}
    return json.dumps(config_shown(shown, reveal=reveal), indent=2, sort_keys=True).splitlines()


def config_diff_html(config, *, reveal=False):
    """Return the unified diff of ``config`` against the version before it, as HTML; secret values masked
    (on both sides, so a changed secret is a changed line of masks) unless ``reveal``."""
    previous = config_previous(config)
    if previous is None:
        return format_html('<span class="st-muted">{}</span>', "the first version")
    before, after = _pretty(previous, reveal), _pretty(config, reveal)
    lines = list(difflib.unified_diff(before, after, f"version {previous.version}", f"version {config.version}", lineterm=""))
    if not lines:
        return format_html('<span class="st-muted">{}</span>', f"the same as version {previous.version}")
    style = {"+": "color: #1a7f37", "-": "color: #cf222e", "@": "color: #6e7781"}
    return format_html(
        '<pre class="st-diff">{}</pre>',
        format_html_join("\n", '<span style="{}">{}</span>', ((style.get(line[:1], ""), line) for line in lines)),
    )


class ConfigSecretsAdminMixin:
    """For an admin page that shows configs: each field of ``revealed_fields`` (one that shows a config with its
    secret values masked) is replaced by its revealing twin for a user who may view secrets. Its objects'
    ``config`` and ``dataloader`` are shown by ``config_display`` and ``dataloader_display`` (list both, and
    their ``_revealed`` twins, in ``readonly_fields``)."""

    revealed_fields = {"config_display": "config_revealed", "dataloader_display": "dataloader_revealed"}

    def get_fields(self, request, obj=None):
        return self._for_reader(request, super().get_fields(request, obj))

    def get_fieldsets(self, request, obj=None):
        return [(name, {**options, "fields": self._for_reader(request, options["fields"])}) for name, options in super().get_fieldsets(request, obj)]

    def _for_reader(self, request, fields):
        if not may_view_secrets(request.user):
            return list(fields)
        return [self.revealed_fields.get(field, field) for field in fields]

    @admin.display(description="Config")
    def config_display(self, obj):
        return masked_json_html(obj.config)

    @admin.display(description="Config")
    def config_revealed(self, obj):
        return pretty_json_html(obj.config)

    @admin.display(description="Dataloader")
    def dataloader_display(self, obj):
        return masked_json_html(obj.dataloader) if obj.dataloader is not None else "—"

    @admin.display(description="Dataloader")
    def dataloader_revealed(self, obj):
        return pretty_json_html(obj.dataloader) if obj.dataloader is not None else "—"


def masked_json_html(value):
    """Return config or dataloader ``value`` as indented JSON in a ``<pre>``, its secret values masked."""
    return pretty_json_html(config_shown(value, reveal=False))


@admin.register(TrainingConfig)
class TrainingConfigAdmin(ConfigSecretsAdminMixin, admin.ModelAdmin):
    form = TrainingConfigForm
    list_display = ["name", "version", "description", "owner", "created_at", "used_at"]
    list_filter = ["created_at"]
    search_fields = ["name", "description"]
    readonly_fields = [
        "version", "owner", "created_at", "used_at", "diff_display", "diff_revealed", "config_display", "config_revealed",
        "dataloader_display", "dataloader_revealed",
    ]  # fmt: skip
    revealed_fields = {**ConfigSecretsAdminMixin.revealed_fields, "diff_display": "diff_revealed"}

    def get_readonly_fields(self, request, obj=None):
        return [*self.readonly_fields, "name"] if obj is not None else self.readonly_fields

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["name", "config", "dataloader", "description"]
        # Shown read-only (a user who may only view), the instance's values are shown: masked by the display fields.
        editable = self.has_change_permission(request, obj)
        bodies = ["config", "dataloader"] if editable else ["config_display", "dataloader_display"]
        fields = ["name", "version", *bodies, "description", "owner", "created_at", "used_at", "diff_display"]
        return self._for_reader(request, fields)

    def get_form(self, request, obj=None, change=False, **kwargs):
        form = super().get_form(request, obj, change=change, **kwargs)
        return type(form.__name__, (form,), {"reveal": may_view_secrets(request.user)})

    def has_delete_permission(self, request, obj=None):
        return False  # versions are history: jobs name the one they ran

    @admin.display(description="Changes from the previous version")
    def diff_display(self, config):
        return config_diff_html(config)

    @admin.display(description="Changes from the previous version")
    def diff_revealed(self, config):
        return config_diff_html(config, reveal=True)

    def save_model(self, request, obj, form, change):
        actor = Actor.for_request(request)
        data = form.cleaned_data
        if not change:
            saved = services.config_create(
                name=data["name"], config=data["config"], dataloader=data.get("dataloader"), description=data.get("description", ""), actor=actor
            )
        else:
            saved, new = services.config_edit(
                config_id=obj.pk, config=data["config"], dataloader=data.get("dataloader"), description=data.get("description", ""), actor=actor
            )
            if new:
                messages.info(request, f"Version {obj.version} was used by a job and cannot change: saved as version {saved.version}.")
        obj.pk, obj.version = saved.pk, saved.version
