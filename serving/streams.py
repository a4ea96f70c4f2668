"""The worker stream's lean path: an ASGI endpoint that opens a plain, valid worker stream without Django's request.

A stream is endless, so whatever serves it is kept for its whole life: under Django's handler that is the
HttpRequest (META, session, messages, resolver match), the StreamingHttpResponse, the request body's
spooled file and two tasks besides the stream's own. A GET with the worker's valid token (and, if any, its
own ``worker_id`` and a well-formed Last-Event-ID) is answered here instead: the same token check, the same
``realtime.streams.stream_body`` and the head the view gets through the middleware. Every other request to the
path (no token or a refused one, another worker's id, another method, a bad Last-Event-ID, a host not
allowed, a body...) goes to ``fallback``, Django's handler, with what was read replayed, and gets today's answer.
"""

import asyncio
import uuid
from contextlib import aclosing

from django.conf import settings
from django.core.handlers.asgi import ASGIHandler
from django.http import QueryDict

from job_queue.takeover import agent_instance
from realtime.streams import STREAM_HEADERS, open_plain, resume_from, stream_body
from worker_agent import protocol

from .lean import plain_headers, replay, security_headers

PATH = protocol.STREAM_PATH
TOKEN_HEADER = protocol.WORKER_TOKEN_HEADER.lower().encode("latin-1")
INSTANCE_HEADER = protocol.AGENT_INSTANCE_HEADER.lower().encode("latin-1")


def plain_stream_request(scope):
    """Return ``(secret, claimed worker id, resume, instance, head)`` for a stream request the lean path may open,
    where ``head`` is the response's header list as the view and the middleware would give it; None for anything
    Django must answer (or might read otherwise: a repeated header, a header name Django would merge)."""
    headers = plain_headers(scope)
    if headers is None:
        return None
    secret = headers.get(TOKEN_HEADER)
    if not secret:
        return None
    try:
        query = QueryDict(scope.get("query_string", b"").decode())
        last_event_id = headers.get(b"last-event-id")
        resume = resume_from(None if last_event_id is None else last_event_id.decode("latin-1"), query.getlist("lastEventId"))
        instance = agent_instance((headers.get(INSTANCE_HEADER) or b"").decode("latin-1"))
    except Exception:  # undecodable, too many fields, a bad Last-Event-ID or agent instance: the view's answer
        return None
    security = security_headers(scope, headers)
    if security is None:
        return None
    head = [
        (b"Content-Type", b"text/event-stream"),
        *((name.encode(), value.encode()) for name, value in STREAM_HEADERS),
        (b"X-Frame-Options", settings.X_FRAME_OPTIONS.upper().encode()),
        *security,
    ]
    return secret.decode("latin-1"), query.get("worker_id"), resume, instance, head


class WorkerStreamEndpoint:
    """ASGI: open a plain, valid worker stream on the event loop (its DB work in a pool thread); hand anything
    else to ``fallback``. An open stream holds its task, a task waiting for the client to go, and the
    library's listener; no thread and no DB connection."""

    def __init__(self, fallback):
        self.fallback = fallback

    @staticmethod
    def handles(scope):
        return scope["type"] == "http" and scope.get("path") == PATH and scope.get("method") == "GET"

    async def __call__(self, scope, receive, send):
        plain = plain_stream_request(scope)
        if plain is None:
            return await self.fallback(scope, receive, send)
        message = await receive()
        if message["type"] != "http.request" or message.get("body") or message.get("more_body"):
            return await self.fallback(scope, replay([message], receive), send)
        secret, claimed_worker_id, resume, instance, head = plain
        body = await open_body(secret, claimed_worker_id, resume, instance)
        if body is None:
            return await self.fallback(scope, replay([message], receive), send)
        await serve(body, head, receive, send)


async def open_body(secret, claimed_worker_id, resume, instance=None):
    """Mark the stream of ``secret``'s worker (opened by the agent ``instance``) open and return its body
    (``stream_body``), or None where the view must answer (the token refused, another worker's id). The token
    and its worker are not kept (its own function, so no frame of the open stream holds them)."""
    stream_id = uuid.uuid4().hex
    opened = await open_plain(secret, claimed_worker_id, stream_id, bool(resume), instance)
    if opened is None:
        return None
    token, current_id = opened
    _, body = await stream_body(token, stream_id, resume, current_id, instance)
    return body


async def serve(body, head, receive, send):
    """Send ``body`` (an async iterator of str) as a 200 with ``head``, as Django's handler sends a streaming
    response, until it ends or the client disconnects; close ``body`` either way."""
    task = asyncio.current_task()
    gone = False

    def disconnected(watch):
        nonlocal gone
        if not watch.cancelled() and watch.exception() is None and watch.result()["type"] == "http.disconnect":
            gone = True
            task.cancel()

    watch = asyncio.ensure_future(receive())
    watch.add_done_callback(disconnected)
    try:
        async with aclosing(body):
            await send({"type": "http.response.start", "status": 200, "headers": head})
            async for part in body:
                for chunk, _ in ASGIHandler.chunk_bytes(part.encode()):
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body"})
    except asyncio.CancelledError:
        if not gone:
            raise  # the server is shutting down
        task.uncancel()
    finally:
        watch.remove_done_callback(disconnected)
        watch.cancel()
