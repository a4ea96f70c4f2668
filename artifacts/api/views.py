"""The operators' side of the artifact store: download one file (the job's API detail lists them)."""

from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import FileResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.views import APIView

from common.errors import NotFound
from common.http import error_responses

from .. import permissions
from ..models import Artifact
from ..storage import CHUNK_BYTES, file_open


# A download's reads (over the network from S3) run here, not in the event loop's default executor, whose few
# threads open and close the worker streams (realtime.db). A download reads one chunk at a time: one thread each.
_READS = ThreadPoolExecutor(max_workers=settings.TRANSFER_THREADS, thread_name_prefix="transfer-read")


async def _chunks(opened):
    """The file ``opened``, CHUNK_BYTES at a time, each read on a download thread; closed at the end."""
    read = sync_to_async(opened.read, thread_sensitive=False, executor=_READS)
    try:
        while chunk := await read(CHUNK_BYTES):
            yield chunk
    finally:
        opened.close()


def artifact_response(artifact):
    """Return a streamed response of ``artifact``'s file, with its size and SHA-256; raise NotFound if the
    storage lost it.

    The body is an async iterator: under ASGI, Django reads a plain file response (a sync iterator) whole
    into memory before it sends a byte (a 256 MiB download took the server's RSS up by 513 MiB,
    ``bench/upload_memory.py``). Chunk by chunk, and with the server waiting while the client's connection
    is full (``serving.daphne``), a download holds a few chunks whatever its size.
    """
    try:
        opened = file_open(artifact.storage_name)
    except FileNotFoundError:
        raise NotFound(f"the file of {artifact.key} is gone from the artifact storage") from None
    response = FileResponse(_chunks(opened), as_attachment=True, filename=artifact.key.rsplit("/", 1)[-1])
    response.set_headers(opened)  # a file response's own headers (type, disposition), as if it read ``opened`` itself
    response["Content-Length"] = str(artifact.size)
    response["ETag"] = f'"{artifact.sha256}"'
    response["X-Checksum-SHA256"] = artifact.sha256
    return response


class ArtifactDownloadView(APIView):
    operator_permissions = {"GET": permissions.DOWNLOAD_ARTIFACTS}

    @extend_schema(
        tags=["artifacts"],
        summary="Download an artifact (streamed; its SHA-256 in X-Checksum-SHA256)",
        responses={200: OpenApiResponse(description="The file"), **error_responses(401, 403, 404)},
    )
    def get(self, request, artifact_id):
        artifact = Artifact.objects.filter(pk=artifact_id).first()
        if artifact is None:
            raise NotFound(f"artifact {artifact_id} does not exist")
        return artifact_response(artifact)
