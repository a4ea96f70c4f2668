"""The API's pagination: ``?limit=`` and ``?offset=``, clamped to what the database can be asked for."""

from rest_framework import pagination

from .inputs import PAGE_OFFSET_MAX, PAGE_SIZE_MAX


class LimitOffsetPagination(pagination.LimitOffsetPagination):
    """DRF's limit/offset pagination with ``limit`` clamped to PAGE_SIZE_MAX and ``offset`` to PAGE_OFFSET_MAX."""

    max_limit = PAGE_SIZE_MAX

    def get_offset(self, request):
        return min(super().get_offset(request), PAGE_OFFSET_MAX)
