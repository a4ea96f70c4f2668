"""Worker protocol endpoints (X-Worker-Token) and the operators' worker administration endpoints."""

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions, status
from rest_framework.response import Response
from rest_framework.views import APIView

from audit.services import Actor
from job_queue import services as job_services
from simpletuner_site.api import client_ip, error_responses, request_actor
from simpletuner_site.errors import InvalidInput, NotFound

from .. import services
from ..authentication import CanManageWorkers, IsWorker, WorkerTokenAuthentication
from ..models import Worker, WorkerStatus
from .serializers import (
    HeartbeatResponseSerializer,
    HeartbeatSerializer,
    JobReportResponseSerializer,
    JobStatusReportSerializer,
    QueueStateSerializer,
    RegisterResponseSerializer,
    RegisterSerializer,
    WorkerCreatedSerializer,
    WorkerCreateSerializer,
    WorkerIdSerializer,
    WorkerListSerializer,
    WorkerSerializer,
    WorkerStatusSerializer,
    WorkerTokenSerializer,
)

STREAM_PATH = "/api/workers/stream"
WORKER_ID_QUERY = OpenApiParameter(
    "worker_id", str, description="Optional; must be the token's own worker (403 otherwise)."
)
STATUS_FILTER = OpenApiParameter(
    "status", str, description=f"Comma-separated statuses to keep ({', '.join(WorkerStatus.values)})."
)


class WorkerAPIView(APIView):
    """Base for endpoints an agent calls: authenticated by its token, bound to its own worker."""

    authentication_classes = [WorkerTokenAuthentication]
    permission_classes = [IsWorker]

    @property
    def worker(self):
        return self.request.user.worker

    @property
    def actor(self):
        return Actor.for_worker(self.worker, client_ip(self.request))

    def check_worker_id(self, claimed):
        """Refuse a request that names a different worker than the token's."""
        if claimed and str(claimed) != self.worker.pk:
            raise exceptions.PermissionDenied(f"this token belongs to worker {self.worker.pk}, not {claimed}")

    def validated(self, serializer_class, data):
        serializer = serializer_class(data=data)
        serializer.is_valid(raise_exception=True)
        self.check_worker_id(serializer.validated_data.get("worker_id"))
        return serializer.validated_data


class RegisterView(WorkerAPIView):
    REFUSALS = (exceptions.AuthenticationFailed, exceptions.NotAuthenticated, exceptions.PermissionDenied)

    def audit_refusal(self, request, exc):
        secret = request.headers.get("X-Worker-Token") or ""
        body = request.data if isinstance(request.data, dict) else {}
        services.worker_register_failed(
            reason=str(exc.detail), token_prefix=secret.strip()[:6], ip=client_ip(request), name=body.get("name", "")
        )

    def initial(self, request, *args, **kwargs):
        try:
            super().initial(request, *args, **kwargs)
        except self.REFUSALS as exc:
            self.audit_refusal(request, exc)
            raise

    @extend_schema(
        tags=["workers"],
        summary="Register (or re-register) the calling worker and learn where to stream from",
        request=RegisterSerializer,
        responses={200: RegisterResponseSerializer, **error_responses(400, 401, 403)},
    )
    def post(self, request):
        try:
            data = self.validated(RegisterSerializer, request.data)
        except exceptions.PermissionDenied as exc:  # a valid token claiming another worker's id
            self.audit_refusal(request, exc)
            raise
        result = services.worker_register(worker_id=self.worker.pk, data=data, actor=self.actor)
        result["sse_url"] = request.build_absolute_uri(f"{STREAM_PATH}?worker_id={self.worker.pk}")
        result["heartbeat_interval"] = services.heartbeat_interval()
        return Response(result)


class HeartbeatView(WorkerAPIView):
    @extend_schema(
        tags=["workers"],
        summary="Report liveness, utilisation and progress",
        request=HeartbeatSerializer,
        responses={200: HeartbeatResponseSerializer, **error_responses(400, 401, 403, 409)},
    )
    def post(self, request):
        data = self.validated(HeartbeatSerializer, request.data)
        return Response(services.worker_heartbeat(worker_id=self.worker.pk, data=data, actor=self.actor))


class JobStatusView(WorkerAPIView):
    @extend_schema(
        tags=["workers"],
        summary="Report a job's status (starting, running, completed, failed, cancelled)",
        request=JobStatusReportSerializer,
        responses={200: JobReportResponseSerializer, **error_responses(400, 401, 403, 404, 409)},
    )
    def post(self, request, job_id):
        data = self.validated(JobStatusReportSerializer, request.data)
        result = job_services.job_report(worker_id=self.worker.pk, job_id=job_id, data=data, actor=self.actor)
        return Response(result)


class QueueView(WorkerAPIView):
    @extend_schema(
        tags=["workers"],
        summary="Ask whether jobs are waiting that this worker could run",
        parameters=[WORKER_ID_QUERY],
        responses={200: QueueStateSerializer, **error_responses(401, 403)},
    )
    def get(self, request):
        self.check_worker_id(request.query_params.get("worker_id"))
        return Response({"has_jobs": job_services.worker_has_jobs(worker_id=self.worker.pk)})


class DisconnectView(WorkerAPIView):
    @extend_schema(
        tags=["workers"],
        summary="Say goodbye: the worker goes offline (an ephemeral one is retired)",
        request=WorkerIdSerializer,
        responses={200: WorkerStatusSerializer, **error_responses(400, 401, 403)},
    )
    def post(self, request):
        self.validated(WorkerIdSerializer, request.data)
        return Response(services.worker_disconnect(worker_id=self.worker.pk, actor=self.actor))


# --- administration -----------------------------------------------------------------------------


class AdminWorkerAPIView(APIView):
    permission_classes = [CanManageWorkers]

    @property
    def actor(self):
        return request_actor(self.request)


def get_worker_or_404(worker_id):
    worker = Worker.objects.filter(pk=worker_id).first()
    if worker is None:
        raise NotFound(f"worker {worker_id} does not exist")
    return worker


class AdminWorkerListView(AdminWorkerAPIView):
    @extend_schema(
        tags=["admin-workers"],
        operation_id="admin_workers_list",
        summary="List workers",
        parameters=[STATUS_FILTER],
        responses={200: WorkerListSerializer, **error_responses(400, 401, 403)},
    )
    def get(self, request):
        workers = Worker.objects.all()
        wanted = request.query_params.get("status")
        if wanted:
            statuses = wanted.split(",")
            unknown = set(statuses) - set(WorkerStatus.values)
            if unknown:
                raise InvalidInput(f"unknown status {', '.join(sorted(unknown))}", code="invalid_filter")
            workers = workers.filter(status__in=statuses)
        return Response({"workers": WorkerSerializer(workers, many=True).data})

    @extend_schema(
        tags=["admin-workers"],
        summary="Create a worker and its token (the token is shown only in this response)",
        request=WorkerCreateSerializer,
        responses={201: WorkerCreatedSerializer, **error_responses(400, 401, 403, 409)},
    )
    def post(self, request):
        serializer = WorkerCreateSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        worker, token = services.worker_create(**serializer.validated_data, actor=self.actor)
        return Response(WorkerCreatedSerializer(worker, context={"token": token}).data, status=status.HTTP_201_CREATED)


class AdminWorkerDetailView(AdminWorkerAPIView):
    @extend_schema(
        tags=["admin-workers"],
        summary="Show one worker",
        responses={200: WorkerSerializer, **error_responses(401, 403, 404)},
    )
    def get(self, request, worker_id):
        return Response(WorkerSerializer(get_worker_or_404(worker_id)).data)

    @extend_schema(
        tags=["admin-workers"],
        summary="Delete a worker that is not online",
        responses={204: OpenApiResponse(description="Deleted"), **error_responses(401, 403, 404, 409)},
    )
    def delete(self, request, worker_id):
        services.worker_delete(worker_id=worker_id, actor=self.actor)
        return Response(status=status.HTTP_204_NO_CONTENT)


class AdminWorkerDrainView(AdminWorkerAPIView):
    @extend_schema(
        tags=["admin-workers"],
        summary="Drain a worker: it finishes its current job and takes no new one",
        request=None,
        responses={200: WorkerSerializer, **error_responses(401, 403, 404, 409)},
    )
    def post(self, request, worker_id):
        worker = services.worker_drain(worker_id=worker_id, actor=self.actor)
        return Response(WorkerSerializer(worker).data)


class AdminWorkerTokenView(AdminWorkerAPIView):
    @extend_schema(
        tags=["admin-workers"],
        summary="Rotate a worker's token: the old one is revoked and its stream closed",
        request=None,
        responses={200: WorkerTokenSerializer, **error_responses(401, 403, 404, 409)},
    )
    def post(self, request, worker_id):
        token = services.worker_rotate_token(worker_id=worker_id, actor=self.actor)
        worker = get_worker_or_404(worker_id)
        return Response({"worker_id": worker.pk, "name": worker.name, "token": token})
