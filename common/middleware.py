"""Middleware shared by every app: what every answer under ``/api/`` carries (no caching; errors as JSON), static files."""

from asgiref.sync import iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings as django_settings
from django.http import HttpResponseBadRequest
from rest_framework.response import Response
from whitenoise.middleware import WhiteNoiseMiddleware

from .http import API_PREFIX, error_code, error_response
from .inputs import text_problem


class _ResponseMiddleware:
    """A middleware that only looks at the response (``respond(request, response)``), sync and async
    alike, so it adds no thread hop to async views (the streams)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self._acall(request)
        return self.respond(request, self.get_response(request))

    async def _acall(self, request):
        return self.respond(request, await self.get_response(request))

    @staticmethod
    def respond(request, response):
        raise NotImplementedError


class APINoStoreMiddleware(_ResponseMiddleware):
    """``Cache-Control: no-store`` on every API response that sets no caching itself.

    API answers carry tokens (a worker's token at creation and rotation), job configs (which hold
    secrets) and a fleet's state: none belongs in a browser's cache or history, or a proxy's. The
    admin's own views already say ``no-store`` (Django's ``never_cache``).
    """

    @staticmethod
    def respond(request, response):
        if request.path.startswith(API_PREFIX) and not response.has_header("Cache-Control"):
            response["Cache-Control"] = "no-store"
        return response


class ApiErrorsAsJsonMiddleware(_ResponseMiddleware):
    """Turn a non-JSON 4xx/5xx response to an ``/api/`` path into the API's error format, keeping its status.

    DRF's own responses are already in that format (rendered as the client asked) and pass untouched;
    this catches what Django answers by itself: its 400/403/500 pages, CSRF failures, DEBUG pages.
    """

    @staticmethod
    def respond(request, response):
        if (
            response.status_code < 400
            or not request.path.startswith(API_PREFIX)
            or isinstance(response, Response)
            or response.get("Content-Type", "").startswith("application/json")
        ):
            return response
        replacement = error_response(
            error_code(response.status_code),
            f"{response.reason_phrase.lower()} ({response.status_code}) for {request.method} {request.path}",
            response.status_code,
        )
        for header in ("Allow", "Retry-After"):
            if header in response:
                replacement[header] = response[header]
        return replacement


class AdminQueryTextMiddleware:
    """Refuse (400) an admin page whose query string holds text no database column can: a NUL or an
    unpaired surrogate in a search (``?q=``) or list filter would otherwise reach PostgreSQL and 500."""

    sync_capable = True
    async_capable = True
    PREFIX = "/admin/"

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def refusal(self, request):
        if not request.path.startswith(self.PREFIX):
            return None
        for key, values in request.GET.lists():
            for text in (key, *values):
                problem = text_problem(text)
                if problem:
                    return HttpResponseBadRequest(f"Bad request: the parameter {key[:50]!r} {problem}.", content_type="text/plain")
        return None

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self._acall(request)
        return self.refusal(request) or self.get_response(request)

    async def _acall(self, request):
        return self.refusal(request) or await self.get_response(request)


class StaticFilesMiddleware(WhiteNoiseMiddleware):
    """WhiteNoise's static file serving, as a middleware that is async-capable too.

    WhiteNoise's own middleware is sync-only: placed in the stack, it makes Django run every request's
    middleware chain on a thread (event loop -> thread -> loop -> thread). Here a request for any other
    path costs one dictionary look-up on the event loop; a static file is served on a thread.
    """

    sync_capable = True
    async_capable = True

    def __init__(self, get_response=None, settings=django_settings):
        super().__init__(get_response, settings=settings)
        if iscoroutinefunction(get_response):
            markcoroutinefunction(self)

    def static_file(self, request):
        if self.autorefresh:  # development: looks on disk
            return self.find_file(request.path_info)
        return self.files.get(request.path_info)

    def __call__(self, request):
        if iscoroutinefunction(self):
            return self._acall(request)
        found = self.static_file(request)
        return self.serve(found, request) if found is not None else self.get_response(request)

    async def _acall(self, request):
        if self.autorefresh:
            found = await sync_to_async(self.static_file, thread_sensitive=False)(request)
        else:
            found = self.files.get(request.path_info)
        if found is None:
            return await self.get_response(request)
        return await sync_to_async(self.serve, thread_sensitive=False)(found, request)
