"""The operators' worker administration endpoints (the agents' own are ``job_queue.api.agent_views``)."""

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import status
from rest_framework.response import Response
from rest_framework.views import APIView

from audit.services import Actor
from common.http import error_responses, status_filter, status_filter_parameter
from common.errors import NotFound
from common.serializers import refuse_fields

from .. import permissions, services
from ..models import Worker, WorkerStatus
from .serializers import (
    WorkerCreatedSerializer,
    WorkerCreateSerializer,
    WorkerListSerializer,
    WorkerSerializer,
)
from ..selectors import held_jobs_attach

STATUS_FILTER = status_filter_parameter(WorkerStatus.values)


# --- administration -----------------------------------------------------------------------------


class AdminWorkerAPIView(APIView):
    """Each view names the permission of each method (``operator_permissions``, checked by ``common.permissions``)."""

    @property
    def actor(self):
        return Actor.for_request(self.request)


def get_worker_or_404(worker_id):
    worker = Worker.objects.filter(pk=worker_id).first()
    if worker is None:
        raise NotFound(f"worker {worker_id} does not exist")
    return worker


class AdminWorkerListView(AdminWorkerAPIView):
    operator_permissions = {"GET": permissions.VIEW_WORKERS, "POST": permissions.CREATE_WORKERS}

    @extend_schema(
        tags=["admin-workers"],
        operation_id="admin_workers_list",
        summary="List workers",
        parameters=[STATUS_FILTER],
        responses={200: WorkerListSerializer, **error_responses(400, 401, 403)},
    )
    def get(self, request):
        workers = Worker.objects.all()
        statuses = status_filter(request, WorkerStatus.values)
        if statuses:
            workers = workers.filter(status__in=statuses)
        workers = held_jobs_attach(list(workers))  # one read for every packing worker's jobs
        return Response({"workers": WorkerSerializer(workers, many=True, context={"request": request}).data})

    @extend_schema(
        tags=["admin-workers"],
        summary="Create a worker and its token (the token is shown only in this response)",
        request=WorkerCreateSerializer,
        responses={201: WorkerCreatedSerializer, **error_responses(400, 401, 403, 409, 413)},
    )
    def post(self, request):
        serializer = WorkerCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        worker, token = services.worker_create(**serializer.validated_data, actor=self.actor)
        return Response(WorkerCreatedSerializer(worker, context={"token": token, "request": request}).data, status=status.HTTP_201_CREATED)


class AdminWorkerDetailView(AdminWorkerAPIView):
    operator_permissions = {"GET": permissions.VIEW_WORKERS, "DELETE": permissions.DELETE_WORKERS}

    @extend_schema(
        tags=["admin-workers"],
        summary="Show one worker",
        responses={200: WorkerSerializer, **error_responses(401, 403, 404)},
    )
    def get(self, request, worker_id):
        return Response(WorkerSerializer(get_worker_or_404(worker_id), context={"request": request}).data)

    @extend_schema(
        tags=["admin-workers"],
        summary="Delete a worker that is not online",
        responses={204: OpenApiResponse(description="Deleted"), **error_responses(401, 403, 404, 409)},
    )
    def delete(self, request, worker_id):
        services.worker_delete(worker_id=worker_id, actor=self.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


class AdminWorkerDrainView(AdminWorkerAPIView):
    operator_permissions = {"POST": permissions.DRAIN_WORKERS}

    @extend_schema(
        tags=["admin-workers"],
        summary="Drain a worker: it finishes its current job and takes no new one",
        request=None,
        responses={200: WorkerSerializer, **error_responses(400, 401, 403, 404, 409)},
    )
    def post(self, request, worker_id):
        refuse_fields(request.data)
        worker = services.worker_drain(worker_id=worker_id, actor=self.actor)
        return Response(WorkerSerializer(worker, context={"request": request}).data)
