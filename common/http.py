"""API plumbing shared by every app: the error format (and its OpenAPI shape) and the client's address."""

from django.http import JsonResponse
from drf_spectacular.utils import OpenApiResponse
from rest_framework import exceptions, serializers, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from .errors import ServiceError

_DRF_CODES = {
    status.HTTP_401_UNAUTHORIZED: "not_authenticated",
    status.HTTP_403_FORBIDDEN: "permission_denied",
    status.HTTP_404_NOT_FOUND: "not_found",
    status.HTTP_405_METHOD_NOT_ALLOWED: "method_not_allowed",
    status.HTTP_415_UNSUPPORTED_MEDIA_TYPE: "unsupported_media_type",
    status.HTTP_429_TOO_MANY_REQUESTS: "throttled",
}


_ERROR_DESCRIPTIONS = {
    400: "Invalid request (code `invalid` with per-field `errors`, or a specific code such as `invalid_filter`)",
    401: "Missing, unknown or revoked credentials (`not_authenticated`)",
    403: "Authenticated but not allowed (`permission_denied`)",
    404: "No such object (`not_found`)",
    409: "Conflicts with the object's current state (`conflict`, `invalid_transition`, `stale_report`)",
}


class ErrorSerializer(serializers.Serializer):
    """The body of every API error."""

    code = serializers.CharField(help_text="Stable machine-readable error code, e.g. `not_found`.")
    detail = serializers.CharField(help_text="Human-readable explanation.")
    errors = serializers.DictField(required=False, help_text="Per-field messages (validation errors only).")


def error_responses(*status_codes):
    """Return ``@extend_schema(responses=...)`` entries documenting ``ErrorSerializer`` for each status."""
    return {code: OpenApiResponse(ErrorSerializer, description=_ERROR_DESCRIPTIONS[code]) for code in status_codes}


def add_throttled_responses(result, generator, request, public):
    """drf-spectacular postprocessing hook: every operation that can refuse a token (401) can also answer
    429 ``throttled`` with ``Retry-After``, once the client's address is past the failed-authentication rate."""
    throttled = {
        "description": "Too many failed authentications from this address (`throttled`); retry after `Retry-After`",
        "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait."}},
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses") if isinstance(operation, dict) else None
            if responses and "401" in responses:
                responses.setdefault("429", throttled)
    return result


def error_body(code, detail, **extra):
    return {"code": code, "detail": detail, **extra}


def error_response(code, detail, status_code, **extra):
    """Return a plain Django JSON error response (for views outside DRF)."""
    return JsonResponse(error_body(code, detail, **extra), status=status_code)


def exception_handler(exc, context):
    """Render every API error as ``{"code", "detail"}`` (plus ``errors`` for field validation)."""
    if isinstance(exc, ServiceError):
        return Response(error_body(exc.code, exc.detail, **exc.extra), status=exc.status_code)
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        response.data = error_body("invalid", "The request is invalid; see errors.", errors=exc.detail)
    else:
        detail = response.data.get("detail", str(exc)) if isinstance(response.data, dict) else str(exc)
        code = _DRF_CODES.get(response.status_code) or getattr(exc, "default_code", None) or "error"
        response.data = error_body(code, str(detail))
    return response


def not_found(request, exception=None):
    """JSON 404 for unknown API paths (Django's HTML page elsewhere)."""
    if request.path.startswith("/api/"):
        return error_response("not_found", f"no endpoint at {request.path}", 404)
    from django.views.defaults import page_not_found

    return page_not_found(request, exception)
