"""ASGI entry point. Worker streams skip Django's per-request thread so idle streams cost no thread."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "simpletuner_site.settings")

import django  # noqa: E402

django.setup(set_prefix=False)

from django.core.exceptions import RequestAborted  # noqa: E402
from django.core.handlers.asgi import ASGIHandler  # noqa: E402

from realtime.urls import STREAM_PATHS  # noqa: E402  the worker stream and the operators' change feed


class StreamAwareASGIHandler(ASGIHandler):
    """Django's ASGI handler, except that stream requests run without a ThreadSensitiveContext.

    Django gives every request its own executor thread for its sync parts; an endless SSE response
    would hold that thread (and, under the library's view, a DB connection) for its whole life. The
    stream view is async and does its DB work in a pool thread that closes its connection, so only
    the middleware's brief sync steps run on the process-wide sync thread.
    """

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") in STREAM_PATHS:
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


application = StreamAwareASGIHandler()
