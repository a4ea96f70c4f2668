"""The API's one request parser: JSON, bounded in size (413) and nesting depth (400) before any view sees it."""

import json

from rest_framework import exceptions, parsers, status

from .inputs import json_depth_exceeds, limit


class RequestTooLarge(exceptions.APIException):
    status_code = status.HTTP_413_REQUEST_ENTITY_TOO_LARGE
    default_code = "request_too_large"
    default_detail = "The request body is too large."


class JSONTooDeep(exceptions.ParseError):
    default_code = "json_too_deep"


def _non_finite(name):
    # NaN and Infinity are not JSON, but Python clients (requests' json=) send them: they parse, and each
    # field decides (a trainer's progress stores null; anything else is a 400 naming the field).
    return float(name.replace("Infinity", "inf"))


class JSONParser(parsers.JSONParser):
    """JSON bodies of at most MAX_REQUEST_BYTES (else 413), nested at most MAX_JSON_DEPTH deep (else 400).

    The body must be UTF-8. Errors are DRF exceptions, so the API renders them as ``{"code", "detail"}``.
    """

    def parse(self, stream, media_type=None, parser_context=None):
        # Django refuses a larger body first, as DRF reads it (DATA_UPLOAD_MAX_MEMORY_SIZE, the same limit:
        # common.http.exception_handler makes that a 413 too); this holds when that check is off.
        most = limit("MAX_REQUEST_BYTES")
        raw = stream.read(most + 1) if stream is not None else b""
        if len(raw) > most:
            raise RequestTooLarge(f"the request body is over {most} bytes; at most {most} are accepted")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise exceptions.ParseError(f"JSON parse error - the body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
        depth = limit("MAX_JSON_DEPTH")
        try:
            data = json.loads(text, parse_constant=_non_finite)
        except RecursionError:
            raise JSONTooDeep(f"JSON nested deeper than {depth} levels") from None
        except ValueError as exc:
            raise exceptions.ParseError(f"JSON parse error - {exc}") from None
        if json_depth_exceeds(data, depth):
            raise JSONTooDeep(f"JSON nested deeper than {depth} levels")
        return data
