"""The operators' side of the artifact store: download one file (the job's API detail lists them), whole or from a
byte range (a download resumed)."""

import re
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import FileResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.views import APIView

from common.errors import NotFound
from common.http import ErrorSerializer, error_response, error_responses

from .. import permissions
from ..models import Artifact
from ..storage import CHUNK_BYTES, download_name, file_open


# A download's reads (over the network from S3) run here, not in the event loop's default executor, whose few
# threads open and close the worker streams (realtime.db). A download reads one chunk at a time: one thread each.
_READS = ThreadPoolExecutor(max_workers=settings.TRANSFER_THREADS, thread_name_prefix="transfer-read")


# One range of bytes, as a resumed download asks for it: bytes=FIRST- or bytes=FIRST-LAST (others: the whole file).
_RANGE = re.compile(r"bytes=(\d{1,19})-(\d{0,19})")


async def _chunks(opened, remaining):
    """``remaining`` bytes of the file ``opened`` from where it stands, CHUNK_BYTES at a time, each read on a download
    thread; closed at the end."""
    read = sync_to_async(opened.read, thread_sensitive=False, executor=_READS)
    try:
        while remaining > 0 and (chunk := await read(min(CHUNK_BYTES, remaining))):
            remaining -= len(chunk)
            yield chunk
    finally:
        opened.close()


def requested_range(headers, artifact):
    """Return ``(first, last)``, the bytes of ``artifact`` a ``Range`` header asks for, or None for the whole file (no
    Range, one not of the form ``bytes=FIRST-[LAST]``, or an ``If-Range`` that is not the file's ETag); ``(size,
    None)`` when FIRST is past the end (416)."""
    match = _RANGE.fullmatch(headers.get("Range", "").strip())
    if match is None or headers.get("If-Range", f'"{artifact.sha256}"') != f'"{artifact.sha256}"':
        return None
    first = int(match.group(1))
    last = min(int(match.group(2)), artifact.size - 1) if match.group(2) else artifact.size - 1
    if first >= artifact.size:
        return artifact.size, None
    return (first, last) if first <= last else None


def artifact_response(artifact, headers=None):
    """Return a streamed response of ``artifact``'s file, with its size and SHA-256; raise NotFound if the
    storage lost it. ``headers`` (the request's) may ask for a range (``requested_range``): 206 with that part,
    416 when it starts past the end.

    The body is an async iterator: under ASGI, Django reads a plain file response (a sync iterator) whole
    into memory before it sends a byte (a 256 MiB download took the server's RSS up by 513 MiB,
    ``bench/upload_memory.py``). Chunk by chunk, and with the server waiting while the client's connection
    is full (``serving.daphne``), a download holds a few chunks whatever its size.
    """
    part = requested_range(headers or {}, artifact)
    if part is not None and part[1] is None:
        response = error_response("range_not_satisfiable", f"the file has {artifact.size} bytes", 416)
        response["Content-Range"] = f"bytes */{artifact.size}"
        return response
    try:
        opened = file_open(artifact.storage_name)
    except FileNotFoundError:
        raise NotFound(f"the file of {artifact.key} is gone from the artifact storage") from None
    first, last = part or (0, artifact.size - 1)
    if first:
        opened.seek(first)
    response = FileResponse(_chunks(opened, last + 1 - first), as_attachment=True, filename=download_name(artifact.key))
    response.set_headers(opened)  # a file response's own headers (type, disposition), as if it read ``opened`` itself
    response["Content-Length"] = str(last + 1 - first)
    response["Accept-Ranges"] = "bytes"
    if part is not None:
        response.status_code = 206
        response["Content-Range"] = f"bytes {first}-{last}/{artifact.size}"
    response["ETag"] = f'"{artifact.sha256}"'
    response["X-Checksum-SHA256"] = artifact.sha256
    return response


class ArtifactDownloadView(APIView):
    operator_permissions = {"GET": permissions.DOWNLOAD_ARTIFACTS}

    @extend_schema(
        tags=["artifacts"],
        summary="Download an artifact (streamed; its SHA-256 in X-Checksum-SHA256); Range: bytes=FIRST- resumes one",
        responses={
            200: OpenApiResponse(description="The file"),
            206: OpenApiResponse(description="The range asked for (Content-Range)"),
            **error_responses(401, 403, 404),
            416: OpenApiResponse(ErrorSerializer, description="The range starts past the end (Content-Range: bytes */SIZE)"),
        },
    )
    def get(self, request, artifact_id):
        artifact = Artifact.objects.filter(pk=artifact_id).first()
        if artifact is None:
            raise NotFound(f"artifact {artifact_id} does not exist")
        return artifact_response(artifact, request.headers)
