"""Middleware shared by every app."""

from asgiref.sync import iscoroutinefunction, markcoroutinefunction

API_PREFIX = "/api/"


class APINoStoreMiddleware:
    """``Cache-Control: no-store`` on every API response that sets no caching itself.

    API answers carry tokens (a worker's token at creation and rotation), job configs (which hold
    secrets) and a fleet's state: none belongs in a browser's cache or history, or a proxy's. The
    admin's own views already say ``no-store`` (Django's ``never_cache``). Sync and async alike, so it
    adds no thread hop to async views.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self._acall(request)
        return self._mark(request, self.get_response(request))

    async def _acall(self, request):
        return self._mark(request, await self.get_response(request))

    @staticmethod
    def _mark(request, response):
        if request.path.startswith(API_PREFIX) and not response.has_header("Cache-Control"):
            response["Cache-Control"] = "no-store"
        return response
