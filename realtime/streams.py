"""The worker SSE stream: django-eventstream's stream, opened only by the worker's own token.

The view is async and does its two short DB touches (authenticate + mark open, mark closed) in a
worker thread that releases its connection at once, so an idle stream holds no thread and no DB
connection (see ``serving.asgi`` for the handler that skips the per-request thread).
"""

import json
import logging
import re
import uuid

from django.http import StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from django_eventstream.eventstream import get_current_event_id
from django_eventstream.utils import parse_last_event_id, sse_encode_event
from django_eventstream.views import stream

from common.errors import InvalidInput
from common.http import error_response
from job_queue.agents import worker_stream_opened
from job_queue.takeover import agent_instance
from job_queue.dispatch import REPLACED_STREAMS, TO_AGENT
from worker_agent import protocol
from workers import services
from workers.authentication import THROTTLED
from workers.models import TokenKind
from workers.streams import agent_key
from workers.throttling import authentication_failed

from .db import in_db_thread
from .event_requests import event_request_for
from .listeners import StreamListener, StreamPrincipal
from .publish import worker_channel
from .resume import requested_resume, resume_from  # noqa: F401 (resume_from: serving.streams reads it here)

logger = logging.getLogger(__name__)


_STREAM_RESET = re.compile(r"(event: " + re.escape(protocol.STREAM_RESET) + r"\n(?:id: [^\n]*\n)?data: )\{")


def typed_stream_reset(chunk):
    """Give the library's ``stream-reset`` event (unknown Last-Event-ID) a ``type`` like every other event."""
    if f"event: {protocol.STREAM_RESET}" not in chunk:
        return chunk
    return _STREAM_RESET.sub(r'\1{"type": "' + protocol.STREAM_RESET + '", ', chunk)


def sse_shutdown(reason, code):
    """Return the SSE text of a ``shutdown`` event telling the agent why its stream ends (``code`` for machines)."""
    event: protocol.ShutdownEvent = {"type": protocol.SHUTDOWN, "reason": reason, "code": code}
    return sse_encode_event(protocol.SHUTDOWN, event, json_encode=True)


def fence(chunk, stream_id, agent):
    """Return ``(chunk, ended)``: the SSE text ``chunk`` as the stream ``stream_id`` of agent ``agent`` (its key,
    ``workers.streams.agent_key``) delivers it, and whether the stream ends after it.

    Every stream of a worker reads the worker's one channel; this makes delivery per agent. A ``job_submit``
    dispatched to another agent is left out; a ``shutdown`` telling other streams that an agent took over
    (``protocol.AGENT_REPLACED``) is left out unless it names this stream, which then ends with it. The
    fields only the server reads (``dispatch.TO_AGENT``, ``dispatch.REPLACED_STREAMS``) never go out.
    """
    if f"event: {protocol.JOB_SUBMIT}\n" not in chunk and f"event: {protocol.SHUTDOWN}\n" not in chunk:
        return chunk, False
    *blocks, rest = chunk.split("\n\n")  # the library yields whole events: ``rest`` is empty
    out = []
    for block in blocks:
        fields = dict(line.split(": ", 1) for line in block.split("\n") if line.startswith(("event: ", "id: ", "data: ")))
        kind = fields.get("event")
        if kind not in (protocol.JOB_SUBMIT, protocol.SHUTDOWN) or (TO_AGENT not in block and REPLACED_STREAMS not in block):
            out.append(block + "\n\n")
            continue
        data = json.loads(fields["data"])
        to, replaced = data.pop(TO_AGENT, None), data.pop(REPLACED_STREAMS, None)
        if (to is not None and to != agent) or (replaced is not None and stream_id not in replaced):
            continue
        out.append(sse_encode_event(kind, data, event_id=fields.get("id"), json_encode=True))
        if replaced is not None:
            return "".join(out), True
    return "".join(out) + rest, False


def _open_worker(token, claimed_worker_id, stream_id, replaying, instance):
    """Return ``(token, current event id, None)`` once the stream of ``token``'s worker is marked open, or
    ``(None, None, refusal)`` where the token belongs to another worker than ``claimed_worker_id``."""
    worker = token.worker
    if claimed_worker_id and claimed_worker_id != worker.pk:
        refusal = f"this token belongs to worker {worker.pk}, not {claimed_worker_id}"
        return None, None, ("permission_denied", refusal, 403, None)
    current = get_current_event_id([worker_channel(worker.pk)])
    worker_stream_opened(worker_id=worker.pk, stream_id=stream_id, replaying=replaying, instance=instance)
    return token, current, None


@in_db_thread
def _open(request, secret, stream_id, replaying, instance):
    """Return ``(token, current event id, None)`` for the worker's own valid token, else ``(None, None, refusal)``
    where a refusal is ``error_response``'s ``(code, detail, status)`` and, when throttled, the seconds to wait."""
    token = services.token_authenticate(kind=TokenKind.WORKER, plaintext=secret)
    if token is None:
        reason = (
            "Invalid token: it may have been rotated; request a new one"
            if secret
            else f"{protocol.WORKER_TOKEN_HEADER} header is required"
        )
        wait = authentication_failed(request, kind=TokenKind.WORKER, presented=secret, reason=reason)
        if wait is not None:
            return None, None, ("throttled", f"{THROTTLED} Expected available in {wait} seconds.", 429, wait)
        return None, None, ("not_authenticated", reason, 401, None)
    return _open_worker(token, request.GET.get("worker_id"), stream_id, replaying, instance)


@in_db_thread
def open_plain(secret, claimed_worker_id, stream_id, replaying, instance):
    """Like ``_open`` for a request that needs no refusal: return ``(token, current event id)`` once the stream is
    marked open, or None (the token refused, another worker's id) having changed nothing but the token's
    last-used mark, so the full view can answer the request from the start."""
    token = services.token_authenticate(kind=TokenKind.WORKER, plaintext=secret)
    if token is None:
        return None
    token, current, _ = _open_worker(token, claimed_worker_id, stream_id, replaying, instance)
    return None if token is None else (token, current)


@in_db_thread
def _close(worker_id, stream_id):
    services.worker_stream_closed(worker_id=worker_id, stream_id=stream_id)


@csrf_exempt  # authenticated by its token header, never a cookie: another method is a JSON 405, not a CSRF page
async def worker_stream(request):
    """GET protocol.STREAM_PATH: the calling worker's dispatch feed (401 without its valid token)."""
    if request.method != "GET":
        response = error_response("method_not_allowed", f"{request.method} is not allowed here: open the stream with GET", 405)
        response["Allow"] = "GET"
        return response
    secret = request.headers.get(protocol.WORKER_TOKEN_HEADER) or ""
    try:
        resume = requested_resume(request) if secret else {}  # without a token: refused (and counted) first
    except ValueError as exc:
        return error_response("invalid_last_event_id", str(exc), 400)
    try:
        instance = agent_instance(request.headers.get(protocol.AGENT_INSTANCE_HEADER)) if secret else None
    except InvalidInput as exc:
        return error_response(exc.code, exc.detail, 400)
    stream_id = uuid.uuid4().hex
    token, current_id, refusal = await _open(request, secret, stream_id, bool(resume), instance)
    if token is None:
        code, detail, status, wait = refusal
        response = error_response(code, detail, status)
        if wait is not None:
            response["Retry-After"] = str(wait)
        return response

    principal, body = await stream_body(token, stream_id, resume, current_id, instance)
    request.user = principal  # the library reads request.user; this skips the session lookup
    response = StreamingHttpResponse(body, content_type="text/event-stream")
    for header, value in STREAM_HEADERS:
        response[header] = value
    return response


STREAM_HEADERS = (("Cache-Control", "no-cache"), ("X-Accel-Buffering", "no"))  # the view's own, after Content-Type


async def stream_body(token, stream_id, resume, current_id, instance=None):
    """Return ``(principal, body)`` for ``token``'s worker stream, just marked open as ``stream_id`` by the agent
    ``instance`` (None: it said none): ``body`` is the stream's SSE text, an async iterator of str that marks the
    stream closed again when it ends, however it ends; it gives the events after ``resume``'s id for the worker's
    channel, else after ``current_id`` (the channel's id read before the stream was marked open), as ``fence``
    lets this stream deliver them. If this raises, the stream is marked closed first.
    """
    # From here the worker is marked stream-connected: whatever happens, this stream is closed again
    # (a stream that failed to open must never count as open).
    worker_id = token.worker_id
    try:
        principal = StreamPrincipal(token.pk, worker_id)
        channel = worker_channel(worker_id)
        # Without a resume point for this channel, start from the id current *before* the stream was
        # marked open, so an event published in between (a dispatch triggered by the open itself) is
        # read from storage, not lost.
        last_ids = {channel: resume[channel]} if channel in resume else parse_last_event_id(current_id)
        event_request = event_request_for([channel], last_ids, principal)
        listener = StreamListener(principal, event_request.channels)
    except BaseException:
        await _close(worker_id, stream_id)
        raise

    agent = agent_key({"id": stream_id, "instance": instance})

    async def body():
        try:
            async for chunk in stream(event_request, listener):
                if principal.revoked:
                    # The library ends a revoked stream with an untyped `stream-error`; agents read
                    # only typed data, so say it as a `shutdown` they understand, then close.
                    yield sse_shutdown(principal.revoked_reason, principal.revoked_code)
                    return
                chunk, ended = fence(chunk, stream_id, agent)
                if chunk:
                    yield typed_stream_reset(chunk)
                if ended:
                    logger.info("stream of worker %s ended: another agent took the worker over", worker_id)
                    return
        finally:
            await _close(worker_id, stream_id)
            logger.info("stream closed for worker %s", worker_id)

    logger.info("stream opened for worker %s%s", worker_id, " (resuming)" if resume else "")
    return principal, body()
