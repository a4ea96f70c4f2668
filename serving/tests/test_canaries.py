"""Canaries for framework upgrades: each fails when framework code that the project copies, subclasses or patches
changes underneath it, checked against the real classes (their source, or their behaviour), never a stand-in.

When one fails after an upgrade: read the new framework code against the piece named in the message, mend the
piece (or drop it, if the framework now does the job), then record the new digest here.
"""

import hashlib
import importlib
import inspect

import pytest

# (module, qualified name, sha256 of its source, what depends on it)
WATCHED = [
    ("django.core.handlers.asgi", "ASGIHandler.__call__", "f756809e9c9308dcccb78a301fccf09196e80cdc4745690f80384d09b69dd102", "serving.asgi.StreamASGIHandler.__call__ re-implements it without ThreadSensitiveContext"),
    ("django.core.handlers.asgi", "ASGIHandler.handle", "98faeb5bef800331e6a8002fbc96b30e4122a23438ae45a047190a531ea11323", "serving.asgi.PooledASGIHandler relies on it calling run_get_response and closing the response"),
    ("django.core.handlers.asgi", "ASGIHandler.listen_for_disconnect", "c729aa315c734f98cc8a6460d75adcae548e97549b6600388666fbbf6fcba2a9", "serving.asgi.StreamASGIHandler.listen_for_disconnect swallows its RequestAborted"),
    ("django.core.handlers.asgi", "ASGIHandler.send_response", "77eda2b08689b44ee277c936092bde02e50f84727f7398480a127e7e9e1dad06", "serving.streams.serve sends a streaming response as it does"),
    ("django.core.handlers.asgi", "ASGIHandler.chunk_bytes", "6c045731cd77bd2da8253e0a55f1d1e8c9c6c78f412f73a4592d5df5dfb6a6ad", "serving.streams.serve chunks the stream with it"),
    ("django.core.handlers.base", "BaseHandler.load_middleware", "a1fb7ee5f8586195da2174d1bbc2bbfc7ca19b9d26ea66412cb434f45bf6d467", "serving.asgi.PooledASGIHandler.load_middleware builds the chain in sync mode and wraps it"),
    ("django.middleware.security", "SecurityMiddleware", "7c0daafdd127de47ad2bb47f63a6c4cb7b77ca64fa0102c8bf35ae54bfe8d15d", "serving.lean.security_headers adds what it adds"),
    ("django.middleware.clickjacking", "XFrameOptionsMiddleware", "b005c3dcd16801e1f195424685998882d855be76154b4571fb9e391f47b12865", "serving.heartbeat/streams add its X-Frame-Options"),
    ("django.http.request", "HttpRequest.get_host", "02735c918f5ce9f1fdbf8acc4329e1a2169dd10548b6295e9c6edc2223cfaeea", "serving.lean.security_headers refuses the hosts it refuses"),
    ("daphne.server", "Server.create_application", "f1e300b4ecf636c85e1a66250e32af2ebb67728f01919678d43e80c794a79a87", "serving.daphne.SpooledBodyServer.create_application is a copy of it"),
    ("daphne.server", "Server.protocol_connected", "3fe5af10e11e8ad79cc2a02bcd398ee99d141fe66442d56c9c9fddba2c9d6225", "serving.daphne.SpooledBodyServer.protocol_connected extends it"),
    ("daphne.server", "Server.handle_reply", "9d9dbaea6de0657aab6d5eaa7e38781b5fd80924c5ddf334bada16aebed09413", "serving.daphne.SpooledBodyServer.handle_reply extends it"),
    ("daphne.http_protocol", "WebRequest.process", "e9babd1c97ce710bda699578b21feafd1f490df6ad8bec45960eba4bbb31e306", "serving.daphne.SpooledBodyQueue reads the body back from protocol.content as it feeds it"),
    ("daphne.http_protocol", "WebRequest.handle_reply", "3e14b239c2602d950e4fb724eb5d31d540aafa6499d08e576132fdb0ad1397ca", "serving.daphne.transport_drained waits on the request it writes to"),
    ("django_eventstream.views", "ListenerManager", "691cd636ad4d1821224f01fe7ac3cd9a5d085724d58967ee6e54f76ae4a62d00", "realtime.listeners.WorkerListenerManager subclasses it and replaces the module's instance"),
    ("django_eventstream.views", "Listener", "81e6f2da0579b0e97f82bcb9dee90e810190d5c44cd0d8b9d6da3ae916799ac3", "realtime.listeners.StreamListener subclasses it (overflow, wake_threadsafe)"),
    ("django_eventstream.views", "stream", "323841b5a717c081ff0e167f37e76f6efa5b886afe5363ff048542bcc84d74db", "realtime.listeners revokes a stream by setting listener.overflow, which this loop reads"),
    ("django.db.models.sql.compiler", "SQLCompiler.results_iter", "d279d61b80a3a1158af6029d13d8410a7aa2a2ab25b67929dda125a6fd459313", "common.prepared.PreparedQuery converts its rows with it"),
    ("django.db.models.query", "get_related_populators", "979430eb75b93969bf0a60d236ea2f7d8748c0931e9104b29804ec7a1c0dab43", "common.prepared.PreparedQuery populates select_related with it"),
    ("django.db.models.query", "RelatedPopulator", "4cc87fb0e18cb0ce1f551d18d7f5a5bc5c9f59824f1df1886c8f6de8c34a8d55", "common.prepared.PreparedQuery populates select_related with it"),
    ("django.db.backends.sqlite3.base", "DatabaseWrapper._start_transaction_under_autocommit", "7315cfc61c1dde12afa3e1dd77790b874b07c8261f505760fcd5f169d1aae763", "common.db.sqlite3 takes its transaction lock around it"),
    ("django.db.backends.base.base", "BaseDatabaseWrapper._commit", "8ebc361e1e8fcb8d33ccb0e4074b5d638269a87a037b7013d6a86fe116388b39", "common.db.sqlite3 releases its transaction lock after it"),
    ("django.db.backends.base.base", "BaseDatabaseWrapper._rollback", "d671ec3bb3c8ed44da28e4a9c17ad387daa3eaee712d38b7af61219492916e07", "common.db.sqlite3 releases its transaction lock after it"),
    ("django.db.backends.base.base", "BaseDatabaseWrapper._close", "d1a3f0e9a11cd0842ea402c2f180e6d1f116753ccc15064e1daef66faa531e7a", "common.db.sqlite3 releases its transaction lock after it"),
]


def source_digest(module, qualname):
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


@pytest.mark.parametrize("module, qualname, digest, reason", WATCHED, ids=[f"{m}.{q}" for m, q, _, _ in WATCHED])
def test_the_framework_code_we_build_on_is_unchanged(module, qualname, digest, reason):
    assert source_digest(module, qualname) == digest, f"{module}.{qualname} changed: {reason}"


def received_form_args(fast_paths, settings):
    """Feed a form POST through daphne's real HTTPFactory and WebRequest (as built for a SpooledBodyServer) on a real
    Twisted HTTPChannel; return the ``args`` Twisted parsed from its body by the time daphne would process it."""
    from daphne.http_protocol import HTTPFactory, WebRequest
    from twisted.internet.testing import StringTransport

    from serving.daphne import SpooledBodyServer

    settings.FAST_PATHS = fast_paths
    server = SpooledBodyServer(application=None, endpoints=["tcp:port=0:interface=127.0.0.1"])  # not run
    server.connections = {}  # as run() starts it
    seen = []

    class Recorded(WebRequest):
        def process(self):  # where daphne would build the application's scope
            seen.append(dict(self.args))

    channel = HTTPFactory(server).buildProtocol(("127.0.0.1", 0))
    channel.requestFactory = Recorded
    channel.makeConnection(StringTransport())
    channel.dataReceived(
        b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: 3\r\n\r\na=1"
    )
    (args,) = seen
    return args


def test_twisted_parses_a_form_body_unless_the_server_turns_it_off(settings):
    """``_parsePOSTFormSubmission`` still means what ``SpooledBodyServer.protocol_connected`` takes it to mean."""
    assert received_form_args(False, settings) == {b"a": [b"1"]}
    assert received_form_args(True, settings) == {}


def test_twisted_pauses_a_channel_for_a_full_send_buffer_with_the_flag_transport_drained_reads():
    from twisted.internet.testing import StringTransport
    from twisted.web.http import HTTPChannel

    channel = HTTPChannel()
    channel.makeConnection(StringTransport())
    assert channel._waitingForTransport is False
    channel.pauseProducing()  # what the transport does when its send buffer passes its limit
    assert channel._waitingForTransport is True
    channel.resumeProducing()
    assert channel._waitingForTransport is False



def test_twisted_gives_a_request_its_head_and_the_channel_its_target_before_its_body():
    """``GuardedRequest.gotLength`` judges a request from its headers and ``channel._path`` (the request-target), which
    Twisted's channel has set by the time it calls it, before the body's first byte: a real daphne request on a
    real channel is refused from its head alone, and its body never reaches its content."""
    from daphne.http_protocol import HTTPFactory
    from twisted.internet.testing import StringTransport

    from serving.daphne import GuardedRequest, SpooledBodyServer
    from worker_agent import protocol

    server = SpooledBodyServer(application=None, endpoints=["tcp:port=0:interface=127.0.0.1"])  # not run
    server.connections = {}
    channel = HTTPFactory(server).buildProtocol(("127.0.0.1", 0))
    transport = StringTransport()
    channel.makeConnection(transport)
    channel.dataReceived(f"PUT {protocol.UPLOAD_PATH}/b/k?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\n".encode())

    (request,) = server.connections
    assert type(request) is GuardedRequest and request._refused
    assert transport.value().startswith(b"HTTP/1.1 401 Unauthorized\r\n")
    channel.dataReceived(b"hello")
    assert request.content.getvalue() == b""  # the body was dropped, never kept
