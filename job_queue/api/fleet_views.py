"""Operators' worker actions that reach the worker's job or the queue: token rotation, undrain, labels."""

from drf_spectacular.utils import extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from audit.services import Actor
from common.fields import Labels, StrictBoolean
from common.http import error_responses
from common.serializers import Serializer, refuse_fields
from workers import permissions as worker_permissions
from workers.api.serializers import WorkerSerializer, WorkerTokenSerializer
from workers.api.views import get_worker_or_404

from .. import fleet


class RotateTokenSerializer(Serializer):
    force = StrictBoolean(
        default=False,
        help_text="Rotate even while the worker runs a job: the job goes back to the queue without spending a retry.",
    )


class AdminWorkerTokenView(APIView):
    operator_permissions = {"POST": worker_permissions.ROTATE_WORKER_TOKENS}

    @extend_schema(
        tags=["admin-workers"],
        summary="Rotate a worker's token: the old one is revoked and its stream closed "
        "(409 worker_busy, naming the job, while it runs one, unless force)",
        request=RotateTokenSerializer,
        responses={200: WorkerTokenSerializer, **error_responses(400, 401, 403, 404, 409)},
    )
    def post(self, request, worker_id):
        get_worker_or_404(worker_id)
        serializer = RotateTokenSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        token, job_id = fleet.worker_rotate_token(
            worker_id=worker_id, actor=Actor.for_request(request), force=serializer.validated_data["force"]
        )
        worker = get_worker_or_404(worker_id)
        return Response({"worker_id": worker.pk, "name": worker.name, "token": token, "requeued_job": job_id})


class AdminWorkerUndrainView(APIView):
    operator_permissions = {"POST": worker_permissions.DRAIN_WORKERS}

    @extend_schema(
        tags=["admin-workers"],
        summary="Put a drained worker back in service: it takes jobs again (idempotent)",
        request=None,
        responses={200: WorkerSerializer, **error_responses(400, 401, 403, 404)},
    )
    def post(self, request, worker_id):
        refuse_fields(request.data)
        get_worker_or_404(worker_id)
        worker = fleet.worker_undrain(worker_id=worker_id, actor=Actor.for_request(request))
        return Response(WorkerSerializer(worker, context={"request": request}).data)


class WorkerLabelsSerializer(Serializer):
    labels = Labels(help_text="The worker's new labels, name -> value (they replace the old ones); the rules: docs/api.md, Limits.")


class AdminWorkerLabelsView(APIView):
    operator_permissions = {"PUT": worker_permissions.CHANGE_WORKER_LABELS}

    @extend_schema(
        tags=["admin-workers"],
        summary="Replace a worker's labels; queued jobs are matched again",
        request=WorkerLabelsSerializer,
        responses={200: WorkerSerializer, **error_responses(400, 401, 403, 404, 413)},
    )
    def put(self, request, worker_id):
        get_worker_or_404(worker_id)
        serializer = WorkerLabelsSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        worker = fleet.worker_set_labels(
            worker_id=worker_id, labels=serializer.validated_data["labels"], actor=Actor.for_request(request)
        )
        return Response(WorkerSerializer(worker, context={"request": request}).data)
