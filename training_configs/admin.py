"""Stored configs in the admin: JSON checked on save, a readable diff against the previous version, and a
used version never changed in place (saving it makes the next version)."""

import difflib
import json

from django import forms
from django.contrib import admin, messages
from django.utils.html import format_html, format_html_join

from audit.services import Actor
from common.errors import ServiceError

from . import services
from .models import TrainingConfig
from .selectors import config_previous


class TrainingConfigForm(forms.ModelForm):
    class Meta:
        model = TrainingConfig
        fields = ["name", "config", "dataloader", "description"]

    def clean_name(self):
        name = self.cleaned_data["name"]
        try:
            services.check_name(name)
        except ServiceError as exc:
            raise forms.ValidationError(exc.detail) from None
        return name

    def clean_config(self):
        value = self.cleaned_data.get("config")
        if not isinstance(value, dict):
            raise forms.ValidationError("The config must be a JSON object ({...}).")
        return value

    def clean_dataloader(self):
        value = self.cleaned_data.get("dataloader")
        if value is not None and not isinstance(value, (dict, list)):
            raise forms.ValidationError("The dataloader must be a JSON object or list, or empty.")
        return value


def _pretty(config):
    return json.dumps(
        {"config": config.config, "dataloader": config.dataloader, "description": config.description}, indent=2, sort_keys=True
    ).splitlines()


def config_diff_html(config):
    """Return the unified diff of ``config`` against the version before it, as HTML."""
    previous = config_previous(config)
    if previous is None:
        return format_html('<span class="st-muted">{}</span>', "the first version")
    lines = list(difflib.unified_diff(_pretty(previous), _pretty(config), f"version {previous.version}", f"version {config.version}", lineterm=""))
    if not lines:
        return format_html('<span class="st-muted">{}</span>', f"the same as version {previous.version}")
    style = {"+": "color: #1a7f37", "-": "color: #cf222e", "@": "color: #6e7781"}
    return format_html(
        '<pre class="st-diff">{}</pre>',
        format_html_join("\n", '<span style="{}">{}</span>', ((style.get(line[:1], ""), line) for line in lines)),
    )


@admin.register(TrainingConfig)
class TrainingConfigAdmin(admin.ModelAdmin):
    form = TrainingConfigForm
    list_display = ["name", "version", "description", "owner", "created_at", "used_at"]
    list_filter = ["created_at"]
    search_fields = ["name", "description"]
    readonly_fields = ["version", "owner", "created_at", "used_at", "diff_display"]

    def get_readonly_fields(self, request, obj=None):
        return [*self.readonly_fields, "name"] if obj is not None else self.readonly_fields

    def get_fields(self, request, obj=None):
        if obj is None:
            return ["name", "config", "dataloader", "description"]
        return ["name", "version", "config", "dataloader", "description", "owner", "created_at", "used_at", "diff_display"]

    def has_delete_permission(self, request, obj=None):
        return False  # versions are history: jobs name the one they ran

    @admin.display(description="Changes from the previous version")
    def diff_display(self, config):
        return config_diff_html(config)

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
