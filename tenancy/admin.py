"""Teams in the admin: their members and limits, changed through the same services as the API (audited)."""

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.widgets import FilteredSelectMultiple
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied

from audit.services import Actor
from common.admin_kit import ReadOnlyAdminMixin
from common.errors import ServiceError
from common.permissions import may

from . import permissions, services
from .models import GPU_HOURS_MAX, LIMIT_FIELDS, MAX_GPUS_MAX, MAX_RUNNING_JOBS_MAX, TEAM_NAME_MAX_CHARS, Limits, Team
from .selectors import limits_of_team


class TeamForm(forms.ModelForm):
    """A team's name, members and limits; saved through the services (``TeamAdmin.save_model``)."""

    may_set_limits = False  # set per request by TeamAdmin.get_form
    members = forms.ModelMultipleChoiceField(
        queryset=get_user_model().objects.order_by("username"), required=False,
        widget=FilteredSelectMultiple("members", is_stacked=False),
    )
    max_running_jobs = forms.IntegerField(min_value=0, max_value=MAX_RUNNING_JOBS_MAX, required=False, help_text="Empty: no limit.")
    max_gpus = forms.IntegerField(
        label="Max GPUs", min_value=0, max_value=MAX_GPUS_MAX, required=False, help_text="Empty: no limit."
    )
    gpu_hours_per_30_days = forms.FloatField(
        label="GPU-hours per 30 days", min_value=0, max_value=GPU_HOURS_MAX, required=False, help_text="Empty: no quota."
    )

    class Meta:
        model = Team
        fields = ["name"]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.instance.pk:
            self.fields["name"].disabled = True
            self.initial.update(members=list(self.instance.members.all()), **limits_of_team(self.instance))
        if not self.may_set_limits:
            for name in LIMIT_FIELDS:
                self.fields[name].disabled = True
                self.fields[name].help_text = "Only an admin (tenancy.set_limits) changes limits."

    def clean_name(self):
        name = self.cleaned_data["name"]
        if not self.instance.pk:
            try:
                services.check_team_name(name)
            except ServiceError as exc:
                raise forms.ValidationError(exc.detail) from None
        return name


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "member_list", "limits_text", "created_at"]
    search_fields = ["name", "members__username"]
    fieldsets = [(None, {"fields": ["name", "members"]}), ("Limits", {"fields": list(LIMIT_FIELDS)})]

    def get_queryset(self, request):
        return super().get_queryset(request).prefetch_related("members").select_related("limits")

    def has_view_permission(self, request, obj=None):
        return may(request.user, permissions.VIEW_TEAMS)

    def has_add_permission(self, request):
        return may(request.user, permissions.ADD_TEAMS)

    def has_change_permission(self, request, obj=None):
        return may(request.user, permissions.CHANGE_TEAMS)

    def has_delete_permission(self, request, obj=None):
        return may(request.user, permissions.DELETE_TEAMS)

    form = TeamForm

    def get_form(self, request, obj=None, change=False, **kwargs):
        kwargs["fields"] = ["name"]  # the model's own; members and limits are the form's, saved by save_model
        form = super().get_form(request, obj, change=change, **kwargs)
        return type(form.__name__, (form,), {"may_set_limits": may(request.user, permissions.SET_LIMITS)})

    def save_model(self, request, obj, form, change):
        data, actor = form.cleaned_data, Actor.for_request(request)
        members = [user.get_username() for user in data["members"]]
        limits = {name: data.get(name) for name in LIMIT_FIELDS} if may(request.user, permissions.SET_LIMITS) else None
        try:
            if change:
                team = services.team_update(name=obj.name, members=members, limits=limits, actor=actor)
            else:
                team = services.team_create(name=data["name"], members=members, actor=actor)
                if limits and any(value is not None for value in limits.values()):
                    services.team_update(name=team.name, limits=limits, actor=actor)
        except ServiceError as exc:  # the form checked what it could (a name taken meanwhile lands here)
            raise PermissionDenied(exc.detail) from None
        obj.pk, obj.name, obj.created_at = team.pk, team.name, team.created_at

    def save_related(self, request, form, formsets, change):
        pass  # the members were saved, audited, by the service

    def delete_model(self, request, obj):
        try:
            services.team_delete(name=obj.name, actor=Actor.for_request(request))
        except ServiceError as exc:
            self.message_user(request, exc.detail, messages.ERROR)

    def delete_queryset(self, request, queryset):
        for team in queryset:
            self.delete_model(request, team)

    @admin.display(description="Members")
    def member_list(self, team):
        return ", ".join(sorted(user.get_username() for user in team.members.all())) or "—"

    @admin.display(description="Limits")
    def limits_text(self, team):
        return limits_text(getattr(team, "limits", None))


def limits_text(row):
    """Return a scope's limits as one short line ("2 running jobs, 8 GPUs, 100 GPU-h / 30 days"), or "none"."""
    if row is None:
        return "none"
    parts = []
    if row.max_running_jobs is not None:
        parts.append(f"{row.max_running_jobs} running jobs")
    if row.max_gpus is not None:
        parts.append(f"{row.max_gpus} GPUs")
    if row.gpu_hours_per_30_days is not None:
        parts.append(f"{row.gpu_hours_per_30_days:g} GPU-h / 30 days")
    return ", ".join(parts) or "none"


@admin.register(Limits)
class LimitsAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Every limit set, read-only: they are set with the API (PUT …/limits) or on a team's page."""

    list_display = ["__str__", "max_running_jobs", "max_gpus", "gpu_hours_per_30_days", "updated_at"]
    list_filter = ["scope"]

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("team", "user")

    def has_view_permission(self, request, obj=None):
        return may(request.user, "tenancy.view_limits")
