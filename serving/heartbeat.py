"""The heartbeat's lean path: an ASGI endpoint that answers a heartbeat changing no state without DRF.

A heartbeat that only says "alive" (``agents.worker_heartbeat_liveness``) is checked by the very
fields, parser and token look-up of ``HeartbeatView``, written with one guarded UPDATE and answered with
the body and headers that view would give. Every other request to the path (a bad token or body, a
worker offline, a job to acknowledge, progress, a refusal...) goes to the ordinary Django handler,
unread body and all, and gets today's answer from ``HeartbeatView``.

The UPDATEs are written by one request thread at a time, in batches (``LivenessWriter``): the
heartbeats that arrive while one batch is being written go together in the next, in one transaction.
Written one per request thread, four threads' UPDATEs raced for SQLite's write lock, and a loser sleeps
in SQLite's busy handler (1, 2, 5, 10... up to 100 ms at a time): at 1,000 heartbeats a second about
one in fifty waited 20-230 ms. On PostgreSQL each was its own commit, each waiting for a WAL flush;
a batch's UPDATEs are now sent in one pipeline, so they wait for one round trip, not one each.
"""

import asyncio
import functools
import io
import logging
import weakref

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections
from rest_framework import exceptions
from rest_framework.fields import empty
from rest_framework.renderers import JSONRenderer

from common.http import API_PREFIX
from common.parsers import JSONParser
from job_queue import agents
from worker_agent import protocol
from workers.api.serializers import HeartbeatSerializer

from .lean import plain_headers, replay, security_headers

logger = logging.getLogger(__name__)

PATH = protocol.HEARTBEAT_PATH
TOKEN_HEADER = protocol.WORKER_TOKEN_HEADER.lower().encode("latin-1")
JSON_TYPES = frozenset({b"application/json", b"application/json; charset=utf-8", b"application/json;charset=utf-8"})
ACCEPTED = frozenset({None, b"*/*", b"application/json"})  # what HeartbeatView would answer with JSON too


# The fields a heartbeat may send, and those it is always validated with: those DRF's validation visits even when
# absent (required, or with a default).
_FIELDS = HeartbeatSerializer().fields
_TAKEN = frozenset(name for name, field in _FIELDS.items() if not field.read_only)
_ALWAYS = frozenset(name for name, field in _FIELDS.items() if field.required or field.default is not empty)


@functools.lru_cache(maxsize=64)
def _validator(names):
    """A ``HeartbeatSerializer`` bound once and left with the fields ``names`` only (a subset of the fields it
    takes, so at most one per shape of heartbeat the serializer accepts). DRF skips an absent optional field
    without a default, so its validation of a heartbeat that sends ``names`` is this one's; visiting the
    fourteen fields (each absent one an exception) and copying them for a new serializer per heartbeat doubled
    the lean path's cost. It holds no state between validations, and the lean path runs on the event loop's one
    thread."""
    serializer = HeartbeatSerializer()
    for name in list(serializer.fields):
        if name not in names:
            del serializer.fields[name]
    return serializer


def heartbeat_fields(body):
    """Return the validated fields of a heartbeat ``body`` (``HeartbeatSerializer``'s own validation, whole: its
    fields, ``validate_<field>`` methods, validators and ``validate``), or None where it (or the parser before it)
    would refuse the body: the full path then answers with the reasons. A field the serializer does not take is
    refused here, before a validator is looked up: no shape of heartbeat that would be refused is cached."""
    try:
        data = JSONParser().parse(io.BytesIO(body))
        if isinstance(data, dict) and not _TAKEN.issuperset(data):
            return None  # an unknown field: HeartbeatView names it (RefuseUnknownFields)
        names = _ALWAYS.union(data) if isinstance(data, dict) else _ALWAYS
        return _validator(names).run_validation(data)
    except exceptions.APIException:  # ValidationError and ParseError among them
        return None


def record_heartbeats(batch):
    """Record the heartbeats of ``batch`` (``(secret, data)`` pairs: each one's token and validated fields) that
    change no state, in one transaction; return each one's response body, or None where the full path must
    decide (a token refused, another worker's id, state to change, a database error)."""
    close_old_connections()
    try:
        return [None if result is None else JSONRenderer().render(result) for result in agents.worker_heartbeats_liveness(batch)]
    finally:
        close_old_connections()


class LivenessWriter:
    """The plain heartbeats of one event loop, recorded by one request thread at a time, in batches.

    The first heartbeat to arrive is written at once; those arriving meanwhile wait and are written
    together next (``MAX_BATCH`` at most per transaction), and so on until none waits. Under load that is
    one thread hop and one commit for many heartbeats; alone, a heartbeat waits for nothing.
    """

    MAX_BATCH = 128  # heartbeats per transaction: a batch holds the rows it wrote until it commits

    def __init__(self, executor):
        self.executor = executor
        self.waiting = []  # [(secret, data, future)]
        self.task = None  # the task writing batches, while there is one

    async def record(self, secret, data):
        """Record one heartbeat; return its response body, or None for the full path."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.waiting.append((secret, data, future))
        if self.task is None:
            self.task = loop.create_task(self._write())
        return await future

    async def _write(self):
        batch = []
        try:
            while self.waiting:
                batch, self.waiting = self.waiting[: self.MAX_BATCH], self.waiting[self.MAX_BATCH :]
                pairs = [(secret, data) for secret, data, _ in batch]
                try:
                    answers = await sync_to_async(record_heartbeats, thread_sensitive=False, executor=self.executor())(pairs)
                except Exception:  # the request threads shut down, say: the full path answers, or says why not
                    logger.warning("The heartbeat's lean path could not record %d heartbeats", len(batch), exc_info=True)
                    answers = [None] * len(batch)
                for (_, _, future), answer in zip(batch, answers):
                    if not future.done():  # a heartbeat whose client left was recorded all the same
                        future.set_result(answer)
                batch = []
        finally:
            self.task = None
            for _, _, future in batch + self.waiting:  # cancelled (the server stopping): none is left waiting
                future.cancel()
            self.waiting = []


def response_headers(scope, headers):
    """Return the headers ``HeartbeatView`` answers a heartbeat with through the middleware (security headers,
    ``no-store``, DRF's ``Allow``/``Vary``; the length aside), or None where the middleware would answer
    otherwise (a host not allowed, a redirect to HTTPS)."""
    security = security_headers(scope, headers)
    if security is None:
        return None
    out = [
        (b"Content-Type", b"application/json"),
        (b"Vary", b"Accept"),
        (b"Allow", b"POST, OPTIONS"),
        *security,
    ]
    if PATH.startswith(API_PREFIX):
        out.append((b"Cache-Control", b"no-store"))
    out.append((b"X-Frame-Options", settings.X_FRAME_OPTIONS.upper().encode()))
    return out


class HeartbeatEndpoint:
    """ASGI: answer a plain heartbeat on the event loop and its ``LivenessWriter``; hand anything else to ``fallback``.

    ``executor()`` returns the request threads' pool, so the lean path holds no more DB connections than
    the rest of the API.
    """

    def __init__(self, fallback, executor):
        self.fallback = fallback
        self.executor = executor
        self.writers = weakref.WeakKeyDictionary()  # event loop -> its LivenessWriter

    def writer(self):
        """This event loop's ``LivenessWriter`` (a server has one loop; tests run one per request)."""
        loop = asyncio.get_running_loop()
        writer = self.writers.get(loop)
        if writer is None:
            writer = self.writers[loop] = LivenessWriter(self.executor)
        return writer

    @staticmethod
    def handles(scope):
        return scope["type"] == "http" and scope.get("path") == PATH and scope.get("method") == "POST"

    async def __call__(self, scope, receive, send):
        headers = plain_headers(scope)
        if headers is None or scope.get("query_string"):  # Django's reading of the request decides
            return await self.fallback(scope, receive, send)
        body, chunks, message = b"", [], None
        most = settings.SIMPLETUNER["MAX_REQUEST_BYTES"]
        while True:
            message = await receive()
            chunks.append(message)
            if message["type"] != "http.request":
                return await self.fallback(scope, replay(chunks, receive), send)
            body += message.get("body", b"")
            if len(body) > most:
                return await self.fallback(scope, replay(chunks, receive), send)
            if not message.get("more_body"):
                break
        secret = headers.get(TOKEN_HEADER)
        plain = (
            secret
            and headers.get(b"content-type", b"").lower() in JSON_TYPES
            and headers.get(b"accept") in ACCEPTED
        )
        out = response_headers(scope, headers) if plain else None
        data = heartbeat_fields(body) if out is not None else None
        answer = None
        if data is not None:
            answer = await self.writer().record(secret.decode("latin-1"), data)
        if answer is None:
            return await self.fallback(scope, replay(chunks, receive), send)
        out.append((b"Content-Length", str(len(answer)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": out})
        await send({"type": "http.response.body", "body": answer})

