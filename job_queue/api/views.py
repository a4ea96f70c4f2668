"""Queue endpoints for operators: submit, list, inspect, cancel, retry."""

from django.http import HttpResponse
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import status
from rest_framework.generics import ListAPIView
from rest_framework.response import Response
from rest_framework.views import APIView

from audit.services import Actor
from common.http import error_responses, query_param, query_parameter, status_filter, status_filter_parameter
from common.errors import InvalidInput, NotFound
from common.serializers import refuse_fields
from tenancy.services import priority_check

from .. import permissions, services
from ..logs import attempt_log_chunk, job_full_log
from ..models import Job, JobStatus
from .serializers import JobDetailSerializer, JobSerializer, JobSubmitSerializer, JobSubmittedSerializer


class JobSubmitView(APIView):
    operator_permissions = {"POST": permissions.SUBMIT_JOBS}

    @extend_schema(
        tags=["queue"],
        summary="Submit a training job",
        request=JobSubmitSerializer,
        responses={201: JobSubmittedSerializer, **error_responses(400, 401, 403, 404, 413)},
    )
    def post(self, request):
        serializer = JobSubmitSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        priority_check(user=request.user, priority=serializer.validated_data["priority"])  # above 0: its own permission
        job, dispatched = services.job_submit(**serializer.validated_data, actor=Actor.for_request(request))
        return _submitted(request, job, dispatched)


def _submitted(request, job, dispatched):
    if job.submitted_by_id is not None and job.submitted_by_id == request.user.pk:
        job.submitted_by = request.user  # the submitter, already loaded by authentication: no query to name them
    body = JobSerializer(job, context={"with_reason": True, "request": request}).data
    body["dispatched"] = dispatched
    body["job_id"] = job.pk
    return Response(body, status=status.HTTP_201_CREATED)


@extend_schema(
    tags=["queue"],
    summary="List jobs, newest first",
    parameters=[
        status_filter_parameter(JobStatus.values),
        query_parameter("worker", "Only jobs assigned to this worker id."),
        OpenApiParameter("mine", {"type": "string", "enum": ["true", "false"]}, description="true: only jobs I submitted."),
    ],
    responses={200: JobSerializer(many=True), **error_responses(400, 401, 403)},
)
class JobListView(ListAPIView):
    operator_permissions = {"GET": permissions.VIEW_JOBS}

    serializer_class = JobSerializer

    def get_queryset(self):
        jobs = Job.objects.select_related("submitted_by", "training_config", "team")
        statuses = status_filter(self.request, JobStatus.values)
        if statuses:
            jobs = jobs.filter(status__in=statuses)
        worker = query_param(self.request, "worker")
        if worker:
            jobs = jobs.filter(worker_id=worker)
        if _flag(self.request, "mine"):
            jobs = jobs.filter(submitted_by_id=self.request.user.pk)
        return jobs

    def get_serializer_context(self):
        # Each queued job says why it waits, as its own page does (one short read per queued job).
        return {**super().get_serializer_context(), "with_reason": True}


def _flag(request, name):
    """Return the boolean query parameter ``name`` (``true``/``false``; absent: False); raise InvalidInput otherwise."""
    value = query_param(request, name, typed=True)
    if value not in (None, "true", "false"):
        raise InvalidInput(f"{name} must be true or false", code="invalid_filter")
    return value == "true"


def _whole_number(request, name, *, default, least):
    """Return the whole-number query parameter ``name`` (``default`` when absent); raise InvalidInput unless it is one
    from ``least`` to 2**62."""
    value = query_param(request, name, typed=True)
    if value is None:
        return default
    if not (value.isascii() and value.isdigit() and least <= int(value) <= 2**62):
        raise InvalidInput(f"{name} must be a whole number from {least}", code="invalid_filter")
    return int(value)


class JobDetailView(APIView):
    operator_permissions = {"GET": permissions.VIEW_JOBS}

    @extend_schema(
        tags=["queue"],
        summary="Show one job with its attempts",
        responses={200: JobDetailSerializer, **error_responses(401, 403, 404)},
    )
    def get(self, request, job_id):
        job = Job.objects.select_related("submitted_by", "training_config", "team").prefetch_related("attempts").filter(pk=job_id).first()
        if job is None:
            raise NotFound(f"job {job_id} does not exist")
        return Response(JobDetailSerializer(job, context={"with_reason": True, "request": request}).data)


class JobCancelView(APIView):
    operator_permissions = {"POST": permissions.CANCEL_JOBS}

    @extend_schema(
        tags=["queue"],
        summary="Cancel a job (a running one is told to stop)",
        request=None,
        responses={200: JobSerializer, **error_responses(400, 401, 403, 404, 409)},
    )
    def post(self, request, job_id):
        refuse_fields(request.data)
        job = services.job_cancel(job_id=job_id, actor=Actor.for_request(request))
        return Response(JobSerializer(job, context={"request": request}).data)


class JobRetryView(APIView):
    operator_permissions = {"POST": permissions.RETRY_JOBS}

    @extend_schema(
        tags=["queue"],
        summary="Retry a failed or cancelled job: a new job with the same settings (retry_of names the old one)",
        request=None,
        responses={201: JobSubmittedSerializer, **error_responses(400, 401, 403, 404, 409)},
    )
    def post(self, request, job_id):
        refuse_fields(request.data)
        job, dispatched = services.job_retry(job_id=job_id, actor=Actor.for_request(request))
        return _submitted(request, job, dispatched)


class JobLogView(APIView):
    operator_permissions = {"GET": permissions.VIEW_JOBS}

    @extend_schema(
        tags=["queue"],
        summary="Download a job's whole log (text/plain): every attempt's output, saying what was cut; with ?attempt=N, "
        "that attempt's output from ?offset= on, as JSON (to follow a log)",
        parameters=[
            OpenApiParameter("attempt", {"type": "integer", "minimum": 1}, description="An attempt's number: answer its output as JSON."),
            OpenApiParameter("offset", {"type": "integer", "minimum": 0}, description="With attempt: the first character to answer (next_offset of the read before)."),
        ],
        responses={(200, "text/plain"): str, (200, "application/json"): dict, **error_responses(400, 401, 403, 404)},
    )
    def get(self, request, job_id):
        number = _whole_number(request, "attempt", default=None, least=1)
        offset = _whole_number(request, "offset", default=0, least=0)
        job = Job.objects.filter(pk=job_id).first()
        if job is None:
            raise NotFound(f"job {job_id} does not exist")
        if number is not None:
            return Response(attempt_log_chunk(job, number=number, offset=offset))
        response = HttpResponse(job_full_log(job), content_type="text/plain; charset=utf-8")
        response["Content-Disposition"] = f'attachment; filename="{job.pk}.log"'
        return response
