"""ASGI entry point: streams run on the event loop without a thread each; every other request makes one hop to a
request thread from a fixed pool (an artifact transfer to a pool of its own)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "simpletuner_site.settings")

import django  # noqa: E402

django.setup(set_prefix=False)

import asyncio  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from asgiref.sync import sync_to_async  # noqa: E402
from django.conf import settings  # noqa: E402
from django.core import signals  # noqa: E402
from django.core.exceptions import RequestAborted  # noqa: E402
from django.core.handlers.asgi import ASGIHandler, get_script_prefix  # noqa: E402
from django.db import close_old_connections  # noqa: E402
from django.urls import set_script_prefix  # noqa: E402

from job_queue.api.heartbeat import HeartbeatEndpoint  # noqa: E402
from realtime.stream_endpoint import WorkerStreamEndpoint  # noqa: E402
from realtime.urls import STREAM_PATHS  # noqa: E402  the worker stream and the operators' change feed
from simpletuner_site.urls import ARTIFACTS_API_PREFIX  # noqa: E402
from worker_agent import protocol  # noqa: E402

# Requests that move an artifact's body to or from storage (an attempt's PUT and GET, an operator's download):
# they run on their own threads (settings.TRANSFER_THREADS), so that however long storage takes, the request
# threads stay free for heartbeats, reports and the API.
TRANSFER_PATHS = (f"{protocol.UPLOAD_PATH}/", ARTIFACTS_API_PREFIX)


class StreamASGIHandler(ASGIHandler):
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

    async def listen_for_disconnect(self, receive):
        """End quietly when the client disconnects (Django raises RequestAborted, which it ignores).

        When the server shuts down it cancels each open request (an SSE stream never ends by itself);
        the disconnect then arrives after ``handle`` stopped waiting, and Django's RequestAborted would
        be logged as a "Task exception was never retrieved" traceback for every open stream.
        """
        try:
            return await super().listen_for_disconnect(receive)
        except RequestAborted:
            return None


class SyncChainASGIHandler(StreamASGIHandler):
    """Django's ASGI handler with the middleware chain built in sync mode, run on a fixed pool of threads.

    Built in async mode, each sync step of the middleware (every ``process_request`` and
    ``process_response`` of Django's own) is a hop of its own from the event loop to a thread and back;
    the API's views are sync anyway. Built in sync mode, the middleware and the view run in one go.
    And rather than a brand-new thread per request (Django's ThreadSensitiveContext), the chain runs on
    one of ``settings.REQUEST_THREADS`` long-lived threads: no thread start per request, and each thread
    keeps its database connection as ``CONN_MAX_AGE`` or the PostgreSQL pool allows (checked and, if
    obsolete or broken, closed before and after each request, by Django's request signals and here).

    An artifact transfer (``TRANSFER_PATHS``) runs the same chain on ``settings.TRANSFER_THREADS`` threads of
    its own instead, so a body still on its way to storage never holds a thread a heartbeat is waiting for.

    Django's ``handle`` sends ``request_started`` from the event loop and closes the response (which
    sends ``request_finished``) through asgiref, so their sync receivers (``reset_queries``,
    ``close_old_connections``) ran on the process's one shared sync thread, on its connections: two
    more hops per request, queued behind every stream's sync steps. Before a submit reached its view
    the first one took 0.40 ms (median), 2.5 ms (p90). Here ``request_started`` is sent by the request's
    own thread just before the chain, and the response is closed on the pool; the rest is Django's.
    """

    def load_middleware(self, is_async=False):
        super().load_middleware(is_async=False)
        chain = self._middleware_chain
        self.threads = ThreadPoolExecutor(max_workers=settings.REQUEST_THREADS, thread_name_prefix="request")
        self.transfer_threads = ThreadPoolExecutor(max_workers=settings.TRANSFER_THREADS, thread_name_prefix="transfer")
        sender = type(self)

        def run(request):
            signals.request_started.send(sender=sender, scope=request.scope)  # close_old_connections among them
            try:
                return chain(request)
            finally:
                close_old_connections()

        on_request_threads = sync_to_async(run, thread_sensitive=False, executor=self.threads)
        on_transfer_threads = sync_to_async(run, thread_sensitive=False, executor=self.transfer_threads)

        async def run_chain(request):
            if request.path_info.startswith(TRANSFER_PATHS):
                return await on_transfer_threads(request)
            return await on_request_threads(request)

        self._middleware_chain = run_chain
        self._on_pool = lambda call: sync_to_async(call, thread_sensitive=False, executor=self.threads)()

    async def handle(self, scope, receive, send):
        """Django 5.2's ``ASGIHandler.handle``, but for where ``request_started`` is sent and the response closed
        (see the class's docstring): the body read, the request built, the response sent while a client's
        disconnect is listened for, exactly as Django does it."""
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        set_script_prefix(get_script_prefix(scope))
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            await self._on_pool(error_response.close)
            return

        async def process_request(request, send):
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass  # the client disconnected during send_response
            return response

        tasks = [
            asyncio.create_task(self.listen_for_disconnect(receive)),
            asyncio.create_task(process_request(request, send)),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass  # the client disconnected
                except AssertionError:
                    body_file.close()
                    raise
            else:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        try:
            response = tasks[1].result()
        except asyncio.CancelledError:
            await self._on_pool(lambda: signals.request_finished.send(sender=type(self)))
        else:
            await self._on_pool(response.close)
        body_file.close()


class StreamAwareASGIHandler:
    """A worker stream's GET to its lean path (``WorkerStreamEndpoint``) and a heartbeat to its own
    (``HeartbeatEndpoint``), each handing what it does not answer itself on; the other stream requests to
    ``StreamASGIHandler``; everything else (API, admin, static) to ``SyncChainASGIHandler``."""

    def __init__(self):
        self.streams = StreamASGIHandler()
        self.worker_streams = WorkerStreamEndpoint(fallback=self.streams)
        self.requests = SyncChainASGIHandler()
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


application = StreamAwareASGIHandler()
