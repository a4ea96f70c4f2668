"""The API's pagination: ``?limit=`` and ``?offset=``, checked (400 when not an integer) and clamped to what
the database can be asked for."""

from rest_framework import pagination

from .errors import InvalidInput
from .inputs import PAGE_OFFSET_MAX, PAGE_SIZE_MAX


class LimitOffsetPagination(pagination.LimitOffsetPagination):
    """DRF's limit/offset pagination, strict about its input: ``limit`` an integer >= 1 (clamped to
    PAGE_SIZE_MAX), ``offset`` an integer >= 0 (clamped to PAGE_OFFSET_MAX); anything else is a 400
    ``invalid_filter`` instead of DRF's silent fallback to the first page."""

    max_limit = PAGE_SIZE_MAX

    def get_limit(self, request):
        limit = _integer_param(request, self.limit_query_param, least=1)
        return self.default_limit if limit is None else min(limit, self.max_limit)

    def get_offset(self, request):
        offset = _integer_param(request, self.offset_query_param, least=0)
        return 0 if offset is None else min(offset, PAGE_OFFSET_MAX)

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        least = {self.limit_query_param: 1, self.offset_query_param: 0}
        for parameter in parameters:
            parameter["schema"]["minimum"] = least[parameter["name"]]
        return parameters


def _integer_param(request, name, *, least):
    """Return the integer query parameter ``name`` (None when absent); raise InvalidInput when it is empty, not
    a whole number, or below ``least``. Any number of digits is taken: past 30 it is clamped anyway."""
    value = request.query_params.get(name)
    if value is None:
        return None
    if not (value.isascii() and value.isdigit()):
        raise InvalidInput(f"{name} must be an integer >= {least}", code="invalid_filter")
    digits = value.lstrip("0") or "0"
    number = 10**30 if len(digits) > 30 else int(digits)
    if number < least:
        raise InvalidInput(f"{name} must be an integer >= {least}", code="invalid_filter")
    return number
