"""daphne, with a request body handed to the application from daphne's own spool file as it reads it, and a
response body sent no faster than its client takes it (both always: they bound the server's memory); and, with
the fast paths on, no form parsing and a garbage collector tuned for a server of many small requests.

daphne (4.2) spools a request body to a temporary file (Twisted does, past 100 KB), then puts the whole
of it, 8 KB at a time, on the application's unbounded input queue in one go: a 1 GB upload is 1 GB
of memory before the application reads a byte. Here that queue is replaced by one that records only
where each chunk lies in the spool file and reads it back when the application asks, so a body
costs the server a few megabytes whatever its size. Everything else is daphne's own.
"""

import asyncio
import collections
import gc
import logging
from functools import partial

from daphne.cli import CommandLineInterface
from daphne.http_protocol import WebRequest
from daphne.server import Server
from django.conf import settings

from .guard import SPOOL, judge_head, route_path, too_large

logger = logging.getLogger(__name__)

READ_BYTES = 1024 * 1024
# How long a refused request's connection stays half-open (our side closed) so its client can read the answer
# while it is still sending: its bytes meanwhile are dropped, never spooled.
LINGER_S = 2.0

# The cyclic garbage collector's thresholds (gen0 allocations, gen1 and gen2 collections; Python's are
# 700, 10, 10). At 700, objects of requests still in flight are promoted to the oldest generation many
# times a second, so a full collection (every object of every open stream: ~300 ms with 1,000 streams on
# 2 cores) came every 2-3 s under 1,000 heartbeats/s and set their p99. At 50,000 a young collection takes
# a few ms and full ones are rare.
GC_THRESHOLDS = (50_000, 20, 10)


def tune_gc():
    """Freeze what is alive now (modules, settings, the application: never garbage) out of every future
    collection, and collect young objects less often (``GC_THRESHOLDS``)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


class _Span:
    """Bytes ``start``..``end`` of the spool file, and whether more body follows them."""

    __slots__ = ("start", "end", "more_body")

    def __init__(self, start, end, more_body):
        self.start, self.end, self.more_body = start, end, more_body


class SpooledBodyQueue:
    """The application's input queue (``put_nowait`` by daphne, ``get`` by the application) for one HTTP
    request whose body lies in ``content``, the request's spool file."""

    def __init__(self, content):
        self._content = content
        self._items = collections.deque()  # ASGI messages, or _Span of body still in the spool file
        self._waiters = collections.deque()

    def put_nowait(self, message):
        is_body = message.get("type") == "http.request"
        body = message.get("body") or b"" if is_body else b""
        last = self._items[-1] if self._items else None
        end = self._content.tell() if is_body else None  # daphne has just read ``body`` from the spool file
        if is_body and isinstance(last, _Span) and last.more_body and last.end == end - len(body):
            last.end, last.more_body = end, bool(message.get("more_body"))  # the next chunk of the same span
        elif body:
            self._items.append(_Span(end - len(body), end, bool(message.get("more_body"))))
        else:
            self._items.append(message)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                break

    async def get(self):
        while not self._items:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            await waiter
        item = self._items[0]
        if not isinstance(item, _Span):
            return self._items.popleft()
        try:
            self._content.seek(item.start)
            data = self._content.read(min(item.end - item.start, READ_BYTES))
        except (ValueError, OSError):  # the spool file is closed: the client went away
            self._items.popleft()
            return {"type": "http.disconnect"}
        item.start += len(data)
        if item.start >= item.end or not data:
            self._items.popleft()
            return {"type": "http.request", "body": data, "more_body": item.more_body}
        return {"type": "http.request", "body": data, "more_body": True}


class _Drain:
    """A push producer registered on a response while its connection's send buffer is full: Twisted's
    HTTPChannel resumes it once the buffer has drained (or stops it when the connection is lost)."""

    __slots__ = ("ready",)

    def __init__(self):
        self.ready = asyncio.Event()

    def pauseProducing(self):
        self.ready.clear()

    def resumeProducing(self):
        self.ready.set()

    def stopProducing(self):
        self.ready.set()


async def transport_drained(request):
    """Return once ``request``'s connection can take more of its response: at once, unless Twisted has paused its
    HTTPChannel for a full send buffer; then when it resumes, or when the connection is lost.

    daphne writes whatever the application sends straight into Twisted's buffer, so without this a body
    read faster than its client takes it (a large download over a slow link) piles up in memory.
    """
    channel = getattr(request, "channel", None)
    if channel is None or not getattr(channel, "_waitingForTransport", False) or request.producer is not None:
        return
    drain = _Drain()
    request.registerProducer(drain, True)
    try:
        await drain.ready.wait()
    finally:
        if request.producer is drain and request.channel is not None:
            request.unregisterProducer()


class GuardedRequest(WebRequest):
    """daphne's request, judged by ``serving.guard`` from its head before its body is read (``gotLength``, which
    Twisted's channel calls once the headers are in), and held to its route's limit and the process's spool
    bound as its bytes arrive. A refused request is answered at once and never reaches the application."""

    _limit = 0  # the most bytes this request's body may have
    _received = 0
    _held = 0  # bytes of the spool this request holds (``SPOOL``)
    _refused = False

    def gotLength(self, length):
        chunked = length is None and self.requestHeaders.hasHeader(b"transfer-encoding")
        path = route_path(self.channel._path)  # the request-target, which Twisted keeps on its channel
        limit, refusal = judge_head(path, self._header, length, chunked)
        if refusal is None and length:
            refusal = SPOOL.take(length)
            self._held = 0 if refusal else length
        if refusal is not None:
            super().gotLength(0)
            self._refuse(refusal)
            return
        self._limit = limit
        super().gotLength(length)

    def _header(self, name):
        values = self.requestHeaders.getRawHeaders(name)
        return values[0] if values else None

    def handleContentChunk(self, data):
        if self._refused:
            return
        self._received += len(data)
        refusal = too_large(self._limit) if self._received > self._limit else None
        if refusal is None and self._received > self._held:  # a chunked body holds the spool as it arrives
            refusal = SPOOL.take(self._received - self._held)
            if refusal is None:
                self._held = self._received
        if refusal is not None:
            self._refuse(refusal)
            return
        super().handleContentChunk(data)

    def requestReceived(self, command, path, version):
        if not self._refused:  # a refused request was answered; its connection is closing
            super().requestReceived(command, path, version)

    def finish(self):
        self._give_back()
        super().finish()

    def connectionLost(self, reason):
        self._give_back()
        super().connectionLost(reason)

    def _give_back(self):
        if self._held:
            SPOOL.give_back(self._held)
            self._held = 0

    def _refuse(self, refusal):
        """Answer ``refusal`` and close: our side at once, the rest after ``LINGER_S`` (or when the client does)."""
        self._refused = True
        self._give_back()
        self.requestHeaders.removeHeader(b"expect")  # no "100 Continue" after the answer
        transport = self.channel.transport
        transport.write(refusal.response())
        half_close = getattr(transport, "loseWriteConnection", None)
        if half_close is None:  # TLS: no half-close
            transport.loseConnection()
            return
        half_close()
        from twisted.internet import reactor  # daphne's, installed by now

        reactor.callLater(LINGER_S, _abort_if_open, transport)


def _abort_if_open(transport):
    if transport.connected and not transport.disconnected:
        transport.abortConnection()


class SpooledBodyServer(Server):
    """``before_stopping``: callables run to their end, each in a thread, once the server is told to stop and
    before daphne cancels the application instances still running (``kill_all_applications``)."""

    def __init__(self, *args, before_stopping=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.before_stopping = tuple(before_stopping)

    def kill_all_applications(self):
        """daphne's own (at shutdown: cancel every request still in flight, streams included), once each of
        ``before_stopping`` has returned. Until then the server still answers: the built-in local worker's
        agent, stopped by one of them, reports its job and says goodbye, and neither is cancelled midway
        (daphne runs its own shutdown triggers side by side, so a trigger of ours would race this one)."""
        if not self.before_stopping:
            return super().kill_all_applications()
        from twisted.internet import defer, threads

        def logged(failure):
            logger.error("Before stopping: %s", failure.getErrorMessage())

        waits = [threads.deferToThread(stop).addErrback(logged) for stop in self.before_stopping]
        return defer.gatherResults(waits).addBoth(lambda _: super(SpooledBodyServer, self).kill_all_applications())

    def run(self):
        if settings.FAST_PATHS:
            tune_gc()  # the application is imported and built by now
        super().run()

    def protocol_connected(self, protocol):
        """daphne's own; an HTTP request becomes a ``GuardedRequest``, and with the fast paths on it also skips Twisted's parsing of a form body into
        ``request.args`` (``_parsePOSTFormSubmission``, which ``serving/tests/test_canaries.py`` holds to its
        meaning on the real ``twisted.web.http.Request``).

        daphne hands the application the raw body and never reads ``args``, and Twisted's parse of the
        Content-Type alone (through the ``email`` package, for every POST) cost a quarter of the event
        loop's time under a stream of small POSTs such as heartbeats.
        """
        if isinstance(protocol, WebRequest):
            if type(protocol) is WebRequest:  # before its channel reads its head (daphne connects it in __init__)
                protocol.__class__ = GuardedRequest
            if settings.FAST_PATHS:
                protocol._parsePOSTFormSubmission = False
        super().protocol_connected(protocol)

    async def handle_reply(self, protocol, message):
        """daphne's own; after a part of a response body that more will follow, wait while the client's
        connection is full (``transport_drained``)."""
        await super().handle_reply(protocol, message)
        if message.get("type") == "http.response.body" and message.get("more_body"):
            await transport_drained(protocol)

    def create_application(self, protocol, scope):
        """daphne's own, with a SpooledBodyQueue for an HTTP request (its body is in ``protocol.content``)."""
        content = getattr(protocol, "content", None)
        if scope.get("type") != "http" or content is None:
            return super().create_application(protocol, scope)
        assert "application_instance" not in self.connections[protocol]
        input_queue = SpooledBodyQueue(content)
        scope.setdefault("asgi", {"version": "3.0"})
        application_instance = self.application(scope=scope, receive=input_queue.get, send=partial(self.handle_reply, protocol))
        if protocol not in self.connections:
            return None
        self.connections[protocol]["application_instance"] = asyncio.ensure_future(
            application_instance, loop=asyncio.get_event_loop()
        )
        return input_queue


class SpooledBodyCommandLineInterface(CommandLineInterface):
    """daphne's command line, serving with a SpooledBodyServer (``before_stopping``: see there)."""

    def __init__(self, *, before_stopping=()):
        super().__init__()
        self.server_class = partial(SpooledBodyServer, before_stopping=before_stopping)
