"""The configs API: list and store configs (a POST of an existing name is its next version), one config's versions."""

from drf_spectacular.utils import extend_schema
from rest_framework.generics import ListAPIView
from rest_framework.response import Response
from rest_framework.views import APIView

from audit.services import Actor
from common.errors import NotFound
from common.http import error_responses

from .. import permissions, services
from ..selectors import config_versions, configs_latest
from .serializers import ConfigCreateSerializer, ConfigDetailSerializer, ConfigSummarySerializer, ConfigVersionSerializer


class ConfigListView(ListAPIView):
    operator_permissions = {"GET": permissions.VIEW_CONFIGS, "POST": permissions.ADD_CONFIGS}
    serializer_class = ConfigSummarySerializer

    def get_queryset(self):
        return configs_latest()

    @extend_schema(
        tags=["configs"],
        summary="Stored configs: the latest version of each, by name",
        responses={200: ConfigSummarySerializer(many=True), **error_responses(400, 401, 403)},
    )
    def get(self, request, *args, **kwargs):
        return super().get(request, *args, **kwargs)

    @extend_schema(
        tags=["configs"],
        summary="Store a config: version 1 of a new name, else the name's next version",
        request=ConfigCreateSerializer,
        responses={201: ConfigVersionSerializer, **error_responses(400, 401, 403, 413)},
    )
    def post(self, request):
        serializer = ConfigCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        created = services.config_create(**serializer.validated_data, actor=Actor.for_request(request))
        return Response(ConfigVersionSerializer(created, context={"request": request}).data, status=201)


class ConfigDetailView(APIView):
    operator_permissions = {"GET": permissions.VIEW_CONFIGS}

    @extend_schema(
        tags=["configs"],
        summary="One stored config with all its versions, newest first",
        responses={200: ConfigDetailSerializer, **error_responses(401, 403, 404)},
    )
    def get(self, request, name):
        versions = list(config_versions(name))
        if not versions:
            raise NotFound(f"no config named {name!r} is stored")
        shown = ConfigVersionSerializer(versions, many=True, context={"request": request}).data
        return Response({"name": name, "latest": versions[0].version, "versions": shown})
