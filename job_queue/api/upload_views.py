"""The artifact store's S3-style endpoints for attempts (``protocol.UPLOAD_PATH``), authenticated by the
attempt's upload token: PUT an object, GET one back (resume), declare a checkpoint complete."""

import re

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema
from rest_framework import exceptions
from rest_framework.response import Response
from rest_framework.views import APIView

from artifacts.api.views import artifact_response
from common.errors import InvalidInput, NotAuthenticated
from common.http import error_responses
from common.serializers import refuse_fields
from common.remote import client_ip
from worker_agent import protocol
from workers.authentication import THROTTLED
from workers.throttling import UPLOAD_TOKEN, authentication_failed

from .. import uploads


STEP_PATTERN = r"^[0-9]{1,18}$"
UPLOAD_TOKEN_AUTH = [{"uploadToken": []}]  # the scheme is declared by workers.api.schema.add_worker_stream_path


def _token(request):
    return request.headers.get(protocol.UPLOAD_SECRET_HEADER) or request.headers.get(protocol.UPLOAD_TOKEN_HEADER) or ""


def _declared_length(request):
    raw = request.META.get("CONTENT_LENGTH") or ""
    if not raw:
        return None
    if not raw.isdigit():
        raise InvalidInput(f"Content-Length must be a number of bytes, not {raw[:40]!r}", code="invalid_length")
    return int(raw)


class UploadTokenView(APIView):
    """Base of the attempt's artifact endpoints: the upload token is checked by the service, not by DRF."""

    authentication_classes = []
    permission_classes = []

    def initial(self, request, *args, **kwargs):
        """Refuse a caller without a live attempt's token, whatever the method: 401, or 429 once its address
        is past the failed-authentication rate (a refused token is counted and audited like any other)."""
        super().initial(request, *args, **kwargs)
        if request.method not in ("HEAD", "OPTIONS") and not hasattr(self, request.method.lower()):
            return  # a method the endpoint does not serve: 405, whoever asks
        token = _token(request)
        try:
            uploads.attempt_for_token(token)
        except NotAuthenticated as exc:
            if token:
                wait = authentication_failed(request, kind=UPLOAD_TOKEN, presented=token, reason="unknown upload token")
                if wait is not None:
                    raise exceptions.Throttled(wait=wait, detail=THROTTLED) from None
            raise exc


class ArtifactObjectView(UploadTokenView):
    @extend_schema(
        tags=["artifacts"],
        auth=UPLOAD_TOKEN_AUTH,
        summary="Upload a file of the attempt's job (S3-style PUT; the body is the file, streamed to storage)",
        parameters=[
            OpenApiParameter(
                protocol.CHECKPOINT_DECLARES_HEADER,
                str,
                OpenApiParameter.HEADER,
                description="1: the file is part of a checkpoint the attempt declares complete itself "
                "(POST /api/cloud/checkpoints/{step}/complete); until then a report or heartbeat does not complete it. "
                "Any other value, or none: a report or heartbeat after the file completes its checkpoint.",
            )
        ],
        request={"application/octet-stream": bytes},
        responses={
            200: OpenApiResponse(description="Stored, replacing the file the key named"),
            201: OpenApiResponse(description="Stored"),
            **error_responses(400, 401, 404, 409, 413),
        },
    )
    def put(self, request, bucket, key):
        artifact, created = uploads.attempt_upload(
            token=_token(request),
            bucket=bucket,
            key=key,
            stream=request._request,
            declared_length=_declared_length(request),
            declares=request.headers.get(protocol.CHECKPOINT_DECLARES_HEADER, "").strip() == "1",
            ip=client_ip(request),
        )
        etag = f'"{artifact.sha256}"'
        body: protocol.UploadResponse = {
            "Key": key,
            "Bucket": bucket,
            "ETag": etag,
            "key": artifact.key,
            "size": artifact.size,
            "sha256": artifact.sha256,
            "attempt": artifact.attempt_number,
            "checkpoint_step": artifact.checkpoint_step,
        }
        return Response(body, status=201 if created else 200, headers={"ETag": etag})

    @extend_schema(
        tags=["artifacts"],
        auth=UPLOAD_TOKEN_AUTH,
        summary="Download a file of the attempt's job (a resuming attempt reads its checkpoint)",
        responses={200: OpenApiResponse(description="The file"), **error_responses(400, 401, 404, 409)},
    )
    def get(self, request, bucket, key):
        artifact = uploads.attempt_download(token=_token(request), bucket=bucket, key=key)
        return artifact_response(artifact)


class CheckpointCompleteView(UploadTokenView):
    @extend_schema(
        tags=["artifacts"],
        auth=UPLOAD_TOKEN_AUTH,
        summary="Declare the attempt's checkpoint of a step complete (all its files uploaded)",
        parameters=[OpenApiParameter("step", {"type": "string", "pattern": STEP_PATTERN}, OpenApiParameter.PATH)],
        request=None,
        responses={200: OpenApiResponse(description="Complete"), **error_responses(400, 401, 404, 409)},
    )
    def post(self, request, step):
        if not re.fullmatch(STEP_PATTERN, step):
            raise InvalidInput(f"the step must be a whole number, not {step[:40]!r}", code="invalid_step")
        refuse_fields(request.data)
        uploads.attempt_declare_checkpoint(token=_token(request), step=int(step), ip=client_ip(request))
        return Response({"step": int(step), "complete": True})
