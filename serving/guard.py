"""What a request may send, judged from its head (method, path, headers, declared length) before a byte of its body
is read, and what the bodies being read may add up to: the rules ``serving.daphne.GuardedRequest`` applies.

- A route's body limit: an attempt's artifact upload (``protocol.UPLOAD_PATH``) the artifact limit
  (``SIMPLETUNER_ARTIFACT_MAX_BYTES``), every other request the API's (``SIMPLETUNER_MAX_REQUEST_BYTES``,
  which Django's form limit for the admin is too). A declared length over it is refused at once; a chunked
  body, as its bytes pass it.
- The token a route needs, where there is a body to read: a worker route (``/api/workers/``) its
  ``X-Worker-Token`` header, an upload an upload token that this orchestrator signed (checked by its
  signature alone: no database on the event loop). The view checks the token in full afterwards, as
  before; a request with no body goes to the view as it comes, whatever its head.
- All bodies being spooled by this process together stay under ``SIMPLETUNER_SPOOL_MAX_BYTES``: past it, a
  new body gets 503 with ``Retry-After``.

A refused request is answered with the API's JSON error (``code``, ``detail``) and its connection closed.
"""

import json
import threading
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import unquote

from django.conf import settings

from artifacts.tokens import token_lease
from worker_agent import protocol

WORKER_ROUTES = protocol.API_PREFIX
UPLOAD_ROUTES = f"{protocol.UPLOAD_PATH}/"
RETRY_AFTER_S = 5


@dataclass(frozen=True)
class Refusal:
    status: int
    code: str
    detail: str
    retry_after: int | None = None

    def response(self):
        """The whole HTTP/1.1 response, closing the connection."""
        body = json.dumps({"code": self.code, "detail": self.detail}).encode()
        head = [
            f"HTTP/1.1 {self.status} {HTTPStatus(self.status).phrase}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Cache-Control: no-store",
            "X-Content-Type-Options: nosniff",
            "Connection: close",
        ]
        if self.retry_after is not None:
            head.append(f"Retry-After: {self.retry_after}")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def route_path(target):
    """The path of a raw request-target (``/a%20b?x=1``) as daphne gives it to the application."""
    return unquote(target.split(b"?", 1)[0].decode("latin-1"))


def body_limit(path):
    """The most bytes a request to ``path`` may send."""
    if path.startswith(UPLOAD_ROUTES):
        return settings.SIMPLETUNER["ARTIFACT_MAX_BYTES"]
    return settings.SIMPLETUNER["MAX_REQUEST_BYTES"]


def too_large(limit):
    return Refusal(413, "request_too_large", f"the request body is over {limit} bytes; at most {limit} are accepted")


def judge_head(path, header, length, chunked):
    """Return ``(limit, None)`` for a request to ``path`` whose body may be read (at most ``limit`` bytes), or
    ``(None, Refusal)``. ``header(name)`` gives a request header's first value (bytes) or None; ``length`` is
    the declared length (None if none); ``chunked``, whether the body comes chunked."""
    if not chunked and not length:
        return 0, None  # no body: the view decides everything
    limit = body_limit(path)
    if length is not None and length > limit:
        return None, too_large(limit)
    if path.startswith(WORKER_ROUTES) and not header(protocol.WORKER_TOKEN_HEADER.encode()):
        return None, Refusal(401, protocol.NOT_AUTHENTICATED, f"a worker request needs its {protocol.WORKER_TOKEN_HEADER}")
    if path.startswith(UPLOAD_ROUTES):
        token = header(protocol.UPLOAD_SECRET_HEADER.encode()) or header(protocol.UPLOAD_TOKEN_HEADER.encode()) or b""
        if token_lease(token.decode("latin-1")) is None:
            return None, Refusal(401, protocol.NOT_AUTHENTICATED, f"an upload needs this attempt's upload token in {protocol.UPLOAD_TOKEN_HEADER}")
    return limit, None


class Spool:
    """The bytes of request bodies this process holds now, all together, under a bound (``SPOOL_MAX_BYTES``)."""

    def __init__(self):
        self.held = 0
        self._lock = threading.Lock()

    def take(self, count):
        """Hold ``count`` more bytes; return a 503 Refusal (holding nothing) where they would pass the bound."""
        with self._lock:
            if self.held + count > settings.SIMPLETUNER["SPOOL_MAX_BYTES"]:
                return Refusal(503, "server_busy", "the server holds as many request bodies as it may; retry shortly",
                               retry_after=RETRY_AFTER_S)  # fmt: skip
            self.held += count
            return None

    def give_back(self, count):
        with self._lock:
            self.held -= count


SPOOL = Spool()
