"""The operators' side of the artifact store: download one file (the job's API detail lists them)."""

from django.http import FileResponse
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.views import APIView

from common.errors import NotFound
from common.http import error_responses

from .. import permissions
from ..models import Artifact
from ..storage import CHUNK_BYTES, file_open


def artifact_response(artifact):
    """Return a streamed response of ``artifact``'s file, with its size and SHA-256; raise NotFound if the
    storage lost it."""
    try:
        opened = file_open(artifact.storage_name)
    except FileNotFoundError:
        raise NotFound(f"the file of {artifact.key} is gone from the artifact storage") from None
    response = FileResponse(opened, as_attachment=True, filename=artifact.key.rsplit("/", 1)[-1])
    response.block_size = CHUNK_BYTES
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
