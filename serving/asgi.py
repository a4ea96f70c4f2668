"""The ASGI application: with the fast paths on, streams on the event loop without a thread each, plain heartbeats
and plain worker streams below Django, every other request on a fixed pool of request threads (an artifact
transfer on a pool of its own); with them off (``SIMPLETUNER_FAST_PATHS=off``), Django's own ASGI handler
(``QuietASGIHandler``)."""

from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler
from django.db import close_old_connections

from common.http import ARTIFACTS_API_PREFIX
from realtime.urls import STREAM_PATHS  # the worker stream and the operators' change feed
from worker_agent import protocol

from .heartbeat import HeartbeatEndpoint
from .streams import WorkerStreamEndpoint

# Requests that move an artifact's body to or from storage (an attempt's PUT and GET, an operator's download):
# they run on their own threads (settings.TRANSFER_THREADS), so that however long storage takes, the request
# threads stay free for heartbeats, reports and the API.
TRANSFER_PATHS = (f"{protocol.UPLOAD_PATH}/", ARTIFACTS_API_PREFIX)
# Sign-ins, whose password hashing (a quarter of a second of CPU each) runs on threads of their own: a flood of
# them never holds a thread a heartbeat or a report is waiting for.
LOGIN_PATHS = ("/admin/login/", "/api-auth/login/")
LOGIN_THREADS = 2


class QuietASGIHandler(ASGIHandler):
    """Django's ASGI handler, ending quietly when a client disconnects after the handler stopped listening.

    When the server shuts down it cancels each open request (an SSE stream never ends by itself); the
    disconnect then arrives after ``handle`` stopped waiting, and Django's RequestAborted would be logged as
    a "Task exception was never retrieved" traceback for every open stream. Not a fast path: the handler
    of every request with the fast paths off too.
    """

    async def listen_for_disconnect(self, receive):
        try:
            return await super().listen_for_disconnect(receive)
        except RequestAborted:
            return None


class StreamASGIHandler(QuietASGIHandler):
    """Django's ASGI handler, except that requests run without a ThreadSensitiveContext.

    Django gives every request its own executor thread for its sync parts; an endless SSE response
    would hold that thread (and, under the library's view, a DB connection) for its whole life. The
    stream view is async and does its DB work in a pool thread that closes its connection, so only
    the middleware's brief sync steps run on the process-wide sync thread.
    """

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            await self.handle(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


class PooledASGIHandler(StreamASGIHandler):
    """Django's ASGI handler with the middleware chain built in sync mode, run on a fixed pool of threads.

    Built in async mode, each sync step of the middleware (every ``process_request`` and
    ``process_response`` of Django's own) is a hop of its own from the event loop to a thread and back;
    the API's views are sync anyway. Built in sync mode, the middleware and the view run in one go.
    And rather than a brand-new thread per request (Django's ThreadSensitiveContext), the chain runs on
    one of ``settings.REQUEST_THREADS`` long-lived threads: no thread start per request, and each thread
    keeps its database connection as ``CONN_MAX_AGE`` or the PostgreSQL pool allows (checked and, if
    obsolete or broken, closed before and after each request here, as Django's request signals do for
    the thread that sends them).

    An artifact transfer (``TRANSFER_PATHS``) runs the same chain on ``settings.TRANSFER_THREADS`` threads of
    its own instead, so a body still on its way to storage never holds a thread a heartbeat is waiting for;
    a sign-in (``LOGIN_PATHS``) on ``LOGIN_THREADS`` of its own, so password hashing never does.
    Everything else, ``handle`` included, is Django's.
    """

    def load_middleware(self, is_async=False):
        super().load_middleware(is_async=False)
        chain = self._middleware_chain
        self.threads = ThreadPoolExecutor(max_workers=settings.REQUEST_THREADS, thread_name_prefix="request")
        self.transfer_threads = ThreadPoolExecutor(max_workers=settings.TRANSFER_THREADS, thread_name_prefix="transfer")
        self.login_threads = ThreadPoolExecutor(max_workers=LOGIN_THREADS, thread_name_prefix="login")

        def run(request):
            close_old_connections()
            try:
                return chain(request)
            finally:
                close_old_connections()

        on_request_threads = sync_to_async(run, thread_sensitive=False, executor=self.threads)
        on_transfer_threads = sync_to_async(run, thread_sensitive=False, executor=self.transfer_threads)
        on_login_threads = sync_to_async(run, thread_sensitive=False, executor=self.login_threads)

        async def run_chain(request):
            if request.path_info.startswith(TRANSFER_PATHS):
                return await on_transfer_threads(request)
            if request.path_info.startswith(LOGIN_PATHS):
                return await on_login_threads(request)
            return await on_request_threads(request)

        self._middleware_chain = run_chain


class FastPathsASGIHandler:
    """A worker stream's GET to its lean path (``WorkerStreamEndpoint``) and a heartbeat to its own
    (``HeartbeatEndpoint``), each handing what it does not answer itself on; the other stream requests to
    ``StreamASGIHandler``; everything else (API, admin, static) to ``PooledASGIHandler``."""

    def __init__(self):
        self.streams = StreamASGIHandler()
        self.worker_streams = WorkerStreamEndpoint(fallback=self.streams)
        self.requests = PooledASGIHandler()
        self.heartbeats = HeartbeatEndpoint(fallback=self.requests, executor=lambda: self.requests.threads)

    _asgi_single_callable = True  # an ASGI 3 application, though ``__call__`` is not itself a coroutine function

    def __call__(self, scope, receive, send):
        """Return the chosen handler's coroutine, not one awaiting it: one frame less for each open stream."""
        if self.worker_streams.handles(scope):
            return self.worker_streams(scope, receive, send)
        if scope["type"] == "http" and scope.get("path") in STREAM_PATHS:
            return self.streams(scope, receive, send)
        if self.heartbeats.handles(scope):
            return self.heartbeats(scope, receive, send)
        return self.requests(scope, receive, send)


def build_application(fast_paths=None):
    """Return the ASGI application: ``FastPathsASGIHandler`` when the fast paths are on (``settings.FAST_PATHS``
    unless ``fast_paths`` says), Django's own ``ASGIHandler`` (quiet at shutdown) for every request when off."""
    if fast_paths is None:
        fast_paths = settings.FAST_PATHS
    return FastPathsASGIHandler() if fast_paths else QuietASGIHandler()
