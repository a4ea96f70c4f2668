"""Request and response shapes of the teams and limits API."""

from rest_framework import serializers

from common.fields import BoundedFloat, BoundedInt, BoundedText
from common.http import api_url
from common.serializers import Serializer

from ..models import GPU_HOURS_MAX, MAX_GPUS_MAX, MAX_RUNNING_JOBS_MAX, TEAM_NAME_MAX_CHARS, TEAM_NAME_PATTERN
from ..services import MEMBERS_MAX

USERNAME_MAX_CHARS = 150  # Django's User.username


class LimitsSerializer(Serializer):
    """A scope's limits; a field left out or null is no limit."""

    max_running_jobs = BoundedInt(min_value=0, max_value=MAX_RUNNING_JOBS_MAX, required=False, allow_null=True, default=None)
    max_gpus = BoundedInt(min_value=0, max_value=MAX_GPUS_MAX, required=False, allow_null=True, default=None)
    gpu_hours_per_30_days = BoundedFloat(min_value=0, max_value=GPU_HOURS_MAX, required=False, allow_null=True, default=None)


class LimitsPatchSerializer(LimitsSerializer):
    """Limits in a team's PATCH: only the fields given change."""

    max_running_jobs = BoundedInt(min_value=0, max_value=MAX_RUNNING_JOBS_MAX, required=False, allow_null=True)
    max_gpus = BoundedInt(min_value=0, max_value=MAX_GPUS_MAX, required=False, allow_null=True)
    gpu_hours_per_30_days = BoundedFloat(min_value=0, max_value=GPU_HOURS_MAX, required=False, allow_null=True)


def _members(**kwargs):
    return serializers.ListField(
        child=BoundedText(max_length=USERNAME_MAX_CHARS), max_length=MEMBERS_MAX, allow_empty=True, **kwargs
    )


class TeamCreateSerializer(Serializer):
    name = BoundedText(max_length=TEAM_NAME_MAX_CHARS, schema_pattern=TEAM_NAME_PATTERN)  # checked by the service
    members = _members(required=False, default=list)


class TeamPatchSerializer(Serializer):
    members = _members(required=False, help_text="Replaces the team's members (usernames).")
    limits = LimitsPatchSerializer(required=False, help_text="The limits to change (needs tenancy.set_limits).")


class TeamSerializer(Serializer):
    name = serializers.CharField()
    members = serializers.ListField(child=serializers.CharField())
    limits = LimitsSerializer()
    created_at = serializers.DateTimeField()
    url = serializers.CharField(help_text="This team's own address in the API.")


def team_shown(team, request, limits):
    """Return ``team`` as the API shows it, with its ``limits`` (``{field: figure or None}``)."""
    return {
        "name": team.name,
        "members": sorted(team.members.values_list("username", flat=True)),
        "limits": limits,
        "created_at": serializers.DateTimeField().to_representation(team.created_at),
        "url": api_url(request, "admin-team", team=team.name),
    }
