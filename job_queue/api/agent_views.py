"""The worker protocol's endpoints (``worker_agent.protocol``), authenticated by the worker's own token."""

from django.conf import settings
from drf_spectacular.utils import extend_schema
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import APIView

from audit.services import Actor
from common.http import error_responses, query_parameter
from common.remote import client_ip
from worker_agent import protocol
from workers import services as worker_services
from workers.api.serializers import (
    HeartbeatResponseSerializer,
    HeartbeatSerializer,
    JobReportResponseSerializer,
    JobStatusReportSerializer,
    QueueStateSerializer,
    RegisterResponseSerializer,
    RegisterSerializer,
    WorkerIdSerializer,
    WorkerStatusSerializer,
)
from workers.authentication import IsWorker, WorkerTokenAuthentication
from workers.throttling import worker_refused, worker_registration_throttled

from .. import agents, reports, takeover

WORKER_ID_QUERY = query_parameter("worker_id", "Optional; must be the token's own worker (403 otherwise).")
REFUSALS_THROTTLED = "Too many refused requests from this worker."
REGISTRATIONS_THROTTLED = "Too many registrations of this worker."


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
        """Refuse a request that names a different worker than the token's: 403, or 429 once the worker is past
        the rate of refusals (``workers.throttling.worker_refused``, which bounds its audit rows)."""
        if claimed and str(claimed) != self.worker.pk:
            detail = f"this token belongs to worker {self.worker.pk}, not {claimed}"
            wait = worker_refused(worker_id=self.worker.pk, address=client_ip(self.request), record=self.claim_audit(detail))
            if wait is not None:
                raise exceptions.Throttled(wait=wait, detail=REFUSALS_THROTTLED)
            raise exceptions.PermissionDenied(detail)

    def claim_audit(self, detail):
        """Return what writes the audit row of a claim to be another worker (the window's first), or None: none."""
        return None

    def validated(self, serializer_class, data):
        serializer = serializer_class(data=data)
        serializer.is_valid(raise_exception=True)
        self.check_worker_id(serializer.validated_data.get("worker_id"))
        return serializer.validated_data


class RegisterView(WorkerAPIView):
    def claim_audit(self, detail):
        request = self.request
        return lambda previous: worker_services.worker_register_failed(
            reason=detail,
            token_prefix=request.auth.prefix,
            ip=client_ip(request),
            name=request.data.get("name", "") if isinstance(request.data, dict) else "",
            refusals_in_previous_window=previous,
        )

    @extend_schema(
        tags=["workers"],
        summary="Register (or re-register) the calling worker and learn where to stream from",
        request=RegisterSerializer,
        responses={200: RegisterResponseSerializer, **error_responses(400, 401, 403, 413)},
    )
    def post(self, request):
        data = self.validated(RegisterSerializer, request.data)
        instance = takeover.agent_instance(request.headers.get(protocol.AGENT_INSTANCE_HEADER))  # 400 if malformed
        wait = worker_registration_throttled(worker_id=self.worker.pk, address=client_ip(request))
        if wait is not None:  # nothing registered: a register/disconnect loop writes a bounded number of rows
            raise exceptions.Throttled(wait=wait, detail=REGISTRATIONS_THROTTLED)
        result = agents.worker_register(worker_id=self.worker.pk, data=data, actor=self.actor, instance=instance)
        stream_path = f"{protocol.STREAM_PATH}?worker_id={self.worker.pk}"
        # SIMPLETUNER_PUBLIC_URL when set; otherwise the request's own address (its Host is one of ALLOWED_HOSTS).
        result["sse_url"] = settings.PUBLIC_URL + stream_path if settings.PUBLIC_URL else request.build_absolute_uri(stream_path)
        result["heartbeat_interval"] = worker_services.heartbeat_interval()
        result["dispatch_ack_timeout"] = settings.SIMPLETUNER["DISPATCH_ACK_TIMEOUT"]
        return Response(result)


class HeartbeatView(WorkerAPIView):
    @extend_schema(
        tags=["workers"],
        summary="Report liveness, utilisation and progress",
        request=HeartbeatSerializer,
        responses={200: HeartbeatResponseSerializer, **error_responses(400, 401, 403, 409, 413)},
    )
    def post(self, request):
        data = self.validated(HeartbeatSerializer, request.data)
        return Response(agents.worker_heartbeat(worker_id=self.worker.pk, data=data, actor=self.actor))


class JobStatusView(WorkerAPIView):
    @extend_schema(
        tags=["workers"],
        summary="Report a job's status (starting, running, completed, failed, cancelled)",
        request=JobStatusReportSerializer,
        responses={200: JobReportResponseSerializer, **error_responses(400, 401, 403, 404, 409, 413)},
    )
    def post(self, request, job_id):
        data = self.validated(JobStatusReportSerializer, request.data)
        result = reports.job_report(worker_id=self.worker.pk, job_id=job_id, data=data, actor=self.actor)
        return Response(result)


class QueueView(WorkerAPIView):
    @extend_schema(
        tags=["workers"],
        summary="Ask for work: whether jobs are waiting that this worker could run (one is dispatched if so)",
        parameters=[WORKER_ID_QUERY],
        request=None,
        responses={200: QueueStateSerializer, **error_responses(400, 401, 403, 413)},
    )
    def post(self, request):
        claimed = self.validated(WorkerIdSerializer, request.data or {}).get("worker_id")
        self.check_worker_id(request.query_params.get("worker_id") or claimed)
        return Response({"has_jobs": agents.worker_ask_for_work(worker_id=self.worker.pk)})

    @extend_schema(
        tags=["workers"],
        summary="Ask for work, as the upstream agent does (GET, though it may dispatch a job: same as POST)",
        parameters=[WORKER_ID_QUERY],
        responses={200: QueueStateSerializer, **error_responses(401, 403)},
    )
    def get(self, request):
        self.check_worker_id(request.query_params.get("worker_id"))
        return Response({"has_jobs": agents.worker_ask_for_work(worker_id=self.worker.pk)})


class DisconnectView(WorkerAPIView):
    @extend_schema(
        tags=["workers"],
        summary="Say goodbye: the worker goes offline (an ephemeral one is retired)",
        request=WorkerIdSerializer,
        responses={200: WorkerStatusSerializer, **error_responses(400, 401, 403, 413)},
    )
    def post(self, request):
        self.validated(WorkerIdSerializer, request.data)
        return Response(agents.worker_disconnect(worker_id=self.worker.pk, actor=self.actor))
