"""The teams and limits API: teams and their members, the limits of the fleet, a team and a user."""

from drf_spectacular.utils import OpenApiResponse, extend_schema, inline_serializer
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from audit.services import Actor
from common.errors import NotFound
from common.http import error_responses
from common.permissions import may

from .. import permissions, services
from ..models import LimitScope, Team
from ..selectors import limits_global, limits_of_team
from .serializers import LimitsSerializer, TeamCreateSerializer, TeamPatchSerializer, TeamSerializer, team_shown


def _team_or_404(name):
    team = Team.objects.filter(name=name).first()
    if team is None:
        raise NotFound(f"no team named {name!r}")
    return team


def _valid(serializer_class, request):
    serializer = serializer_class(data=request.data)
    serializer.is_valid(raise_exception=True)
    return serializer.validated_data


class TeamListView(APIView):
    operator_permissions = {"GET": permissions.VIEW_TEAMS, "POST": permissions.ADD_TEAMS}

    @extend_schema(
        tags=["teams"],
        operation_id="admin_teams_list",
        summary="List teams",
        responses={200: inline_serializer("TeamList", {"teams": TeamSerializer(many=True)}), **error_responses(401, 403)},
    )
    def get(self, request):
        teams = Team.objects.prefetch_related("limits")
        return Response({"teams": [team_shown(t, request, limits_of_team(t)) for t in teams]})

    @extend_schema(
        tags=["teams"],
        summary="Create a team with its members",
        request=TeamCreateSerializer,
        responses={201: TeamSerializer, **error_responses(400, 401, 403, 404, 409, 413)},
    )
    def post(self, request):
        team = services.team_create(**_valid(TeamCreateSerializer, request), actor=Actor.for_request(request))
        return Response(team_shown(team, request, limits_of_team(team)), status=status.HTTP_201_CREATED)


class TeamDetailView(APIView):
    operator_permissions = {"GET": permissions.VIEW_TEAMS, "PATCH": permissions.CHANGE_TEAMS, "DELETE": permissions.DELETE_TEAMS}

    @extend_schema(tags=["teams"], summary="One team", responses={200: TeamSerializer, **error_responses(401, 403, 404)})
    def get(self, request, team):
        team = _team_or_404(team)
        return Response(team_shown(team, request, limits_of_team(team)))

    @extend_schema(
        tags=["teams"],
        summary="Change a team's members and/or limits (limits need tenancy.set_limits)",
        request=TeamPatchSerializer,
        responses={200: TeamSerializer, **error_responses(400, 401, 403, 404, 413)},
    )
    def patch(self, request, team):
        data = _valid(TeamPatchSerializer, request)
        if "limits" in data and not may(request.user, permissions.SET_LIMITS):
            raise services.Forbidden(f"You need the {permissions.SET_LIMITS} permission to change limits")
        team = services.team_update(name=team, actor=Actor.for_request(request), **data)
        return Response(team_shown(team, request, limits_of_team(team)))

    @extend_schema(
        tags=["teams"],
        summary="Delete a team that has no queued or running job",
        responses={204: OpenApiResponse(description="Deleted"), **error_responses(401, 403, 404, 409)},
    )
    def delete(self, request, team):
        services.team_delete(name=team, actor=Actor.for_request(request))
        return Response(status=status.HTTP_204_NO_CONTENT)


class TeamLimitsView(APIView):
    operator_permissions = {"PUT": permissions.SET_LIMITS}

    @extend_schema(
        tags=["limits"], summary="Set a team's limits", request=LimitsSerializer,
        responses={200: LimitsSerializer, **error_responses(400, 401, 403, 404, 413)},
    )
    def put(self, request, team):
        values = _valid(LimitsSerializer, request)
        return Response(services.limits_set(scope=LimitScope.TEAM, team=team, values=values, actor=Actor.for_request(request)))


class UserLimitsView(APIView):
    operator_permissions = {"PUT": permissions.SET_LIMITS}

    @extend_schema(
        tags=["limits"], summary="Set a user's limits", request=LimitsSerializer,
        responses={200: LimitsSerializer, **error_responses(400, 401, 403, 404, 413)},
    )
    def put(self, request, username):
        values = _valid(LimitsSerializer, request)
        return Response(
            services.limits_set(scope=LimitScope.USER, username=username, values=values, actor=Actor.for_request(request))
        )


class GlobalLimitsView(APIView):
    operator_permissions = {"GET": permissions.VIEW_TEAMS, "PUT": permissions.SET_LIMITS}

    @extend_schema(tags=["limits"], summary="The fleet's limits", responses={200: LimitsSerializer, **error_responses(401, 403)})
    def get(self, request):
        return Response(limits_global())

    @extend_schema(
        tags=["limits"], summary="Set the fleet's limits", request=LimitsSerializer,
        responses={200: LimitsSerializer, **error_responses(400, 401, 403, 413)},
    )
    def put(self, request):
        values = _valid(LimitsSerializer, request)
        return Response(services.limits_set(scope=LimitScope.GLOBAL, values=values, actor=Actor.for_request(request)))
