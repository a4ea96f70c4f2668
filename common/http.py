"""API plumbing shared by every app: the error format (and its OpenAPI shape) and the client's address."""

import re

from django.conf import settings
from django.core.exceptions import RequestDataTooBig
from django.http import JsonResponse
from django.urls import reverse
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework import exceptions, serializers, status
from rest_framework.response import Response
from rest_framework.views import exception_handler as drf_exception_handler

from worker_agent import protocol

from .errors import InvalidInput, ServiceError
from .serializers import Serializer
from .inputs import NO_NUL_PATTERN, QUERY_PARAM_MAX_CHARS, text_problem

API_PREFIX = "/api/"
ARTIFACTS_API_PREFIX = "/api/artifacts/"  # the operators' artifact downloads (serving.asgi runs them as transfers)

_DRF_CODES = {
    status.HTTP_400_BAD_REQUEST: "bad_request",
    status.HTTP_401_UNAUTHORIZED: protocol.NOT_AUTHENTICATED,  # the wire protocol's 401 code
    status.HTTP_403_FORBIDDEN: "permission_denied",
    status.HTTP_404_NOT_FOUND: "not_found",
    status.HTTP_405_METHOD_NOT_ALLOWED: "method_not_allowed",
    status.HTTP_413_REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    status.HTTP_415_UNSUPPORTED_MEDIA_TYPE: "unsupported_media_type",
    status.HTTP_429_TOO_MANY_REQUESTS: "throttled",
    status.HTTP_500_INTERNAL_SERVER_ERROR: "server_error",
}


def error_code(status_code):
    """Return the error ``code`` the API gives a bare HTTP status (``not_found`` for 404...)."""
    return _DRF_CODES.get(status_code, "error")


_ERROR_DESCRIPTIONS = {
    400: "Invalid request (code `invalid` with per-field `errors`, or a specific code such as `invalid_filter`, `parse_error`, `json_too_deep`)",
    401: "Missing, unknown or revoked credentials (`not_authenticated`)",
    403: "Authenticated but not allowed (`permission_denied`)",
    404: "No such object (`not_found`)",
    409: "Conflicts with the object's current state (`conflict`, `invalid_transition`, `stale_report`)",
    413: "The request body is over the size limit (`request_too_large`)",
}


class ErrorSerializer(Serializer):
    """The body of every API error."""

    code = serializers.CharField(help_text="Stable machine-readable error code, e.g. `not_found`.")
    detail = serializers.CharField(help_text="Human-readable explanation.")
    errors = serializers.DictField(required=False, help_text="Per-field messages (validation errors only).")


def error_responses(*status_codes):
    """Return ``@extend_schema(responses=...)`` entries documenting ``ErrorSerializer`` for each status."""
    return {code: OpenApiResponse(ErrorSerializer, description=_ERROR_DESCRIPTIONS[code]) for code in status_codes}


def add_throttled_responses(result, generator, request, public):
    """drf-spectacular postprocessing hook: every operation that can refuse a token (401) can also answer
    429 ``throttled`` with ``Retry-After``, once the client's address is past the failed-authentication rate (or,
    on the worker protocol, the worker past the same rate of refusals or registrations: ``workers.throttling``)."""
    throttled = {
        "description": "Too many failed authentications from this address, or refused requests or registrations of this "
        "worker (`throttled`); retry after `Retry-After`",
        "headers": {"Retry-After": {"schema": {"type": "integer"}, "description": "Seconds to wait."}},
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    }
    for operations in result.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses") if isinstance(operation, dict) else None
            if responses and "401" in responses:
                responses.setdefault("429", throttled)
    return result


def any_value_is_nullable(result, generator, request, public):
    """Postprocessing hook: drf-spectacular writes a nullable field of any JSON value as
    ``oneOf: [{}, {type: null}]`` under OpenAPI 3.1, which no value satisfies (null matches both); "any
    value" already includes null, so the ``oneOf`` goes."""

    def walk(node):
        if isinstance(node, dict):
            if node.get("oneOf") in ([{}, {"type": "null"}], [{"type": "null"}, {}]):
                del node["oneOf"]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(result)
    return result


def api_url(request, name, **kwargs):
    """Return the address of the route ``name`` (absolute when the ``request`` is known, else a path)."""
    path = reverse(name, kwargs=kwargs)
    return request.build_absolute_uri(path) if request is not None else path


def error_body(code, detail, **extra):
    return {"code": code, "detail": detail, **extra}


def error_response(code, detail, status_code, **extra):
    """Return a plain Django JSON error response (for views outside DRF)."""
    return JsonResponse(error_body(code, detail, **extra), status=status_code)


def query_param(request, name, *, typed=False):
    """Return the query parameter ``name`` (None when absent, or empty unless ``typed``); raise InvalidInput
    (``invalid_filter``) when it is over QUERY_PARAM_MAX_CHARS or holds a NUL or an unpaired surrogate, and,
    for a ``typed`` one (a number, a boolean, a date-time), when it is present but empty."""
    value = request.query_params.get(name)
    if not value:
        if typed and value is not None:
            raise InvalidInput(f"{name} must not be empty", code="invalid_filter")
        return None
    problem = text_problem(value) or (f"is over {QUERY_PARAM_MAX_CHARS} characters" if len(value) > QUERY_PARAM_MAX_CHARS else None)
    if problem:
        raise InvalidInput(f"{name} {problem}", code="invalid_filter")
    return value


def query_parameter(name, description="", *, pattern=NO_NUL_PATTERN, format=None):
    """Return the OpenAPI declaration of a text query parameter, bounded as ``query_param`` reads it."""
    schema = {"type": "string", "maxLength": QUERY_PARAM_MAX_CHARS, "pattern": pattern}
    if format:
        schema = {"type": "string", "format": format}
    return OpenApiParameter(name, schema, description=description)


def status_filter_parameter(choices):
    """Return the OpenAPI ``?status=`` parameter: a comma-separated list of ``choices`` (empty: no filter)."""
    one = "|".join(re.escape(value) for value in choices)
    return query_parameter(
        "status", f"Comma-separated statuses to keep ({', '.join(choices)}).", pattern=f"^(({one})(,({one}))*)?$"
    )


def status_filter(request, choices):
    """Return the statuses named by ``?status=`` (None when absent); raise InvalidInput on one not in ``choices``."""
    wanted = query_param(request, "status")
    if not wanted:
        return None
    statuses = wanted.split(",")
    unknown = set(statuses) - set(choices)
    if unknown:
        raise InvalidInput(f"unknown status {', '.join(sorted(unknown))}", code="invalid_filter")
    return statuses


def exception_handler(exc, context):
    """Render every API error as ``{"code", "detail"}`` (plus ``errors`` for field validation)."""
    if isinstance(exc, ServiceError):
        return Response(error_body(exc.code, exc.detail, **exc.extra), status=exc.status_code)
    if isinstance(exc, RequestDataTooBig):  # Django's own check (DATA_UPLOAD_MAX_MEMORY_SIZE), as DRF reads the body
        most = settings.DATA_UPLOAD_MAX_MEMORY_SIZE
        return Response(
            error_body("request_too_large", f"the request body is over {most} bytes; at most {most} are accepted"),
            status=status.HTTP_413_REQUEST_ENTITY_TOO_LARGE,
        )
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    if isinstance(exc, exceptions.ValidationError):
        response.data = error_body("invalid", "The request is invalid; see errors.", errors=exc.detail)
    else:
        detail = response.data.get("detail", str(exc)) if isinstance(response.data, dict) else str(exc)
        own = getattr(exc, "default_code", None)  # parse_error, json_too_deep, ...: more telling than bad_request
        code = (own if response.status_code == 400 else None) or _DRF_CODES.get(response.status_code) or own or "error"
        response.data = error_body(code, str(detail))
    return response


def not_found(request, exception=None):
    """JSON 404 for unknown API paths (Django's HTML page elsewhere)."""
    if request.path.startswith(API_PREFIX):
        return error_response("not_found", f"no endpoint at {request.path}", 404)
    from django.views.defaults import page_not_found

    return page_not_found(request, exception)
