"""The heartbeat's lean path: an ASGI endpoint that answers a heartbeat changing no state without DRF.

A heartbeat that only says "alive" (``agents.worker_heartbeat_liveness``) is checked by the very
fields, parser and token look-up of ``HeartbeatView``, written with one guarded UPDATE and answered with
the body and headers that view would give. Every other request to the path (a bad token or body, a
worker offline, a job to acknowledge, progress, a refusal...) goes to the ordinary Django handler,
unread body and all, and gets today's answer from ``HeartbeatView``.
"""

import io
import logging

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import DatabaseError, close_old_connections
from rest_framework import exceptions
from rest_framework.renderers import JSONRenderer

from common.http import API_PREFIX
from common.lean_asgi import plain_headers, replay, security_headers
from common.parsers import JSONParser
from worker_agent import protocol
from workers.api.serializers import HeartbeatSerializer

from .. import agents

logger = logging.getLogger(__name__)

PATH = protocol.HEARTBEAT_PATH
TOKEN_HEADER = protocol.WORKER_TOKEN_HEADER.lower().encode("latin-1")
JSON_TYPES = frozenset({b"application/json", b"application/json; charset=utf-8", b"application/json;charset=utf-8"})
ACCEPTED = frozenset({None, b"*/*", b"application/json"})  # what HeartbeatView would answer with JSON too
FIELDS = HeartbeatSerializer().fields  # bound once; each field's own checks run per request


def heartbeat_fields(body):
    """Return the validated fields of a heartbeat ``body`` as ``HeartbeatSerializer`` would, or None where
    it (or the parser before it) would refuse the body: the full path then answers with the reasons."""
    try:
        data = JSONParser().parse(io.BytesIO(body))
    except exceptions.APIException:
        return None
    if not isinstance(data, dict):
        return None
    validated = {}
    try:
        for name, field in FIELDS.items():
            if name in data:
                validated[name] = field.run_validation(data[name])
    except (exceptions.ValidationError, exceptions.APIException):
        return None
    return validated


def record_heartbeat(secret, data):
    """Record a heartbeat that changes no state, authenticated by its token ``secret``; return the response
    body, or None for anything the full path must decide (a token refused, another worker's id, state to change)."""
    close_old_connections()
    try:
        result = agents.worker_heartbeat_liveness(secret=secret, data=data)
        return None if result is None else JSONRenderer().render(result)
    except DatabaseError:
        logger.warning("The heartbeat's lean path failed; the full path answers it", exc_info=True)
        return None
    finally:
        close_old_connections()


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
    """ASGI: answer a plain heartbeat on the event loop and one request thread; hand anything else to ``fallback``.

    ``executor()`` returns the request threads' pool, so the lean path holds no more DB connections than
    the rest of the API.
    """

    def __init__(self, fallback, executor):
        self.fallback = fallback
        self.executor = executor

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
            answer = await sync_to_async(record_heartbeat, thread_sensitive=False, executor=self.executor())(
                secret.decode("latin-1"), data
            )
        if answer is None:
            return await self.fallback(scope, replay(chunks, receive), send)
        out.append((b"Content-Length", str(len(answer)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": out})
        await send({"type": "http.response.body", "body": answer})

