"""The worker stream's lean path (``serving.streams``): a plain, valid stream opens without Django's
request, with the view's head and text; every other request gets the view's answer, byte for byte."""

import asyncio
import json
import logging

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from asgiref.testing import ApplicationCommunicator
from django.test import override_settings

from audit.services import Actor
from serving import streams as stream_endpoint  # noqa: I001
from serving.asgi import StreamASGIHandler
from simpletuner_site.asgi import application
from simpletuner_site.tests.asgi_support import asgi_exchange, rest_of_body
from worker_agent import protocol
from workers.models import Token, Worker
from workers.services import worker_rotate_token
from workers.tests.factories import WorkerFactory, worker_token
from workers.tests.support import audit_rows, clear_failed_auth_counters

pytestmark = pytest.mark.django_db(transaction=True)

TOKEN = protocol.WORKER_TOKEN_HEADER.lower().encode()
PAD = b":" + b" " * 2048 + b"\n\n"


def scope_of(method="GET", *, headers=(), query=b"", scheme="http", path=protocol.STREAM_PATH, host=b"testserver"):
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": scheme,
            "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
            "headers": [(b"host", host), *headers], "client": ("127.0.0.1", 1234),
            "server": ("testserver", 80)}


@pytest.fixture
def fallbacks(monkeypatch):
    """The requests the lean path handed to Django's handler (their methods)."""
    calls = []
    endpoint = application.worker_streams
    original = endpoint.fallback

    async def spy(scope, receive, send):
        calls.append(scope["method"])
        return await original(scope, receive, send)

    monkeypatch.setattr(endpoint, "fallback", spy)
    return calls


async def _open(app, scope, body=b""):
    """Open a stream: return ``(communicator, start message, first body message)``."""
    comm = ApplicationCommunicator(app, scope)
    await comm.send_input({"type": "http.request", "body": body, "more_body": False})
    start = await comm.receive_output(10)
    first = await comm.receive_output(10) if start["status"] == 200 else None
    return comm, start, first


async def _hang_up(comm):
    await comm.send_input({"type": "http.disconnect"})
    await comm.wait(10)


def open_and_close(app, scope, body=b""):
    """Open a stream through ``app`` and hang up: ``(status, ordered header list, first body message)``."""

    async def run():
        comm, start, first = await _open(app, scope, body)
        await _hang_up(comm)
        return start["status"], start["headers"], first

    return async_to_sync(run)()


def answer(app, scope, body=b""):
    """One refused request through ``app``: ``(status, ordered header list, body)``."""
    clear_failed_auth_counters()
    start, out = async_to_sync(asgi_exchange)(app, scope, body=body)
    return start["status"], start["headers"], out


def stream_state(worker):
    worker = Worker.objects.get(pk=worker.pk)
    return worker.stream_id, len(worker.open_streams or ())


# --- a plain, valid stream: the lean path -----------------------------------------------------------


@pytest.mark.parametrize("secure", [False, True])
@pytest.mark.parametrize("query", [b"", b"worker_id={id}", b"worker_id={id}&other=1"])
def test_the_lean_stream_opens_with_the_views_head_and_text(fallbacks, secure, query):
    worker = WorkerFactory()
    token = worker_token(worker)
    headers = [(TOKEN, token.encode()), (b"accept", b"text/event-stream")]
    if secure:
        headers.append((b"x-forwarded-proto", b"https"))
    scope = scope_of(headers=headers, query=query.replace(b"{id}", worker.pk.encode()))
    with override_settings(SECURE_PROXY_SSL_HEADER=("HTTP_X_FORWARDED_PROTO", "https") if secure else None,
                           SECURE_HSTS_SECONDS=3600):
        lean = open_and_close(application, scope)
        assert fallbacks == []
        full = open_and_close(StreamASGIHandler(), scope)

    assert lean == full
    status, head, first = lean
    assert status == 200
    assert head[:3] == [(b"Content-Type", b"text/event-stream"), (b"Cache-Control", b"no-cache"),
                        (b"X-Accel-Buffering", b"no")]
    assert (b"Strict-Transport-Security" in dict(head)) is secure
    assert first == {"type": "http.response.body", "body": PAD + b"event: stream-open\ndata:\n\n", "more_body": True}
    assert stream_state(worker) == (None, 0)  # both streams marked closed when the client went


def test_a_lean_stream_is_marked_open_until_the_client_goes(fallbacks, caplog):
    worker = WorkerFactory()
    scope = scope_of(headers=[(TOKEN, worker_token(worker).encode())])

    async def run():
        comm, start, _ = await _open(application, scope)
        opened = await sync_to_async(stream_state)(worker)
        await _hang_up(comm)
        return start["status"], opened

    with caplog.at_level(logging.INFO, logger="realtime.streams"):
        status, opened = async_to_sync(run)()

    assert (status, fallbacks) == (200, [])
    assert opened[0] is not None and opened[1] == 1
    assert stream_state(worker) == (None, 0)
    assert f"stream opened for worker {worker.pk}" in caplog.text
    assert f"stream closed for worker {worker.pk}" in caplog.text


def test_a_lean_stream_resumes_and_an_unknown_id_gets_a_typed_reset_as_the_view_gives_it(fallbacks):
    worker = WorkerFactory()
    token = worker_token(worker)
    scope = scope_of(headers=[(TOKEN, token.encode()), (b"last-event-id", f"worker-{worker.pk}:999".encode())])

    lean = open_and_close(application, scope)
    full = open_and_close(StreamASGIHandler(), scope)

    assert fallbacks == []
    assert lean == full
    text = lean[2]["body"].decode()
    assert f"event: {protocol.STREAM_RESET}" in text
    assert f'data: {{"type": "{protocol.STREAM_RESET}", "channels": ["worker-{worker.pk}"]}}' in text


def test_a_rotated_token_ends_the_lean_stream_with_a_shutdown_and_then_is_refused(fallbacks):
    worker = WorkerFactory()
    token = worker_token(worker)
    scope = scope_of(headers=[(TOKEN, token.encode())])

    async def run():
        comm, start, _ = await _open(application, scope)
        await sync_to_async(worker_rotate_token)(worker_id=worker.pk, actor=Actor.system())
        text = await rest_of_body(comm)
        await comm.wait(10)
        return start["status"], text.decode()

    status, text = async_to_sync(run)()

    assert status == 200
    assert f"event: {protocol.SHUTDOWN}" in text
    event = json.loads(text.split("data: ", 1)[1].split("\n", 1)[0])
    assert (event["type"], event["code"]) == (protocol.SHUTDOWN, protocol.TOKEN_REVOKED)
    assert stream_state(worker) == (None, 0)
    # The old token is refused at once (nothing cached), by the view
    assert answer(application, scope)[0] == 401
    assert fallbacks == ["GET"]


def test_a_lean_stream_is_marked_closed_when_the_server_shuts_down(fallbacks):
    worker = WorkerFactory()
    scope = scope_of(headers=[(TOKEN, worker_token(worker).encode())])

    async def run():
        comm, start, _ = await _open(application, scope)
        comm.future.cancel()  # what daphne does to every open request when it stops
        with pytest.raises(asyncio.CancelledError):
            await comm.future
        return start["status"]

    assert async_to_sync(run)() == 200
    assert stream_state(worker) == (None, 0)


# --- everything else: the view's answer, byte for byte ------------------------------------------------


def _refusals(worker, token, other):
    plain = [(TOKEN, token.encode())]
    return {
        "no token": (scope_of(), b""),
        "a bad token": (scope_of(headers=[(TOKEN, b"wt_nope")]), b""),
        "a rotated-out token": (scope_of(headers=[(TOKEN, other.encode())]), b""),
        "another worker's id": (scope_of(headers=plain, query=b"worker_id=w_someone_else"), b""),
        "a bad Last-Event-ID": (scope_of(headers=[*plain, (b"last-event-id", b"nonsense")]), b""),
        "a bad lastEventId": (scope_of(headers=plain, query=b"lastEventId=nonsense"), b""),
        "POST": (scope_of("POST", headers=plain), b""),
        "a host not allowed": (scope_of(headers=plain, host=b"evil.example"), b""),
        "a repeated token header": (scope_of(headers=[*plain, (TOKEN, b"wt_nope")]), b""),
        "a token header spelt with _": (scope_of(headers=[(TOKEN.replace(b"-", b"_"), token.encode())]), b""),
        "a body": (scope_of(headers=plain), b"{}"),
    }


@pytest.mark.parametrize("case", ["no token", "a bad token", "a rotated-out token", "another worker's id",
                                  "a bad Last-Event-ID", "a bad lastEventId", "POST", "a host not allowed",
                                  "a repeated token header", "a token header spelt with _"])
def test_every_other_request_gets_the_views_answer_byte_for_byte(fallbacks, case):
    worker = WorkerFactory()
    other = worker_token(worker)
    token = worker_token(worker)  # ``other`` is still valid: rotate it out by revoking all but the newest
    Token.objects.filter(worker=worker).exclude(pk=Token.objects.filter(worker=worker).latest("pk").pk).update(
        revoked_at="2020-01-01T00:00:00Z"
    )
    scope, body = _refusals(worker, token, other)[case]
    before = stream_state(worker)

    with override_settings(ALLOWED_HOSTS=["testserver"]):
        lean = answer(application, scope, body)
        rows = len(audit_rows())
        full = answer(StreamASGIHandler(), scope, body)

    assert lean == full
    assert lean[0] in (400, 401, 403, 405)
    assert fallbacks == ([] if scope["method"] != "GET" else ["GET"])  # another method never enters the lean path
    assert len(audit_rows()) == 2 * rows  # a refused token is counted (and audited) once per request
    assert stream_state(worker) == before  # nothing was ever marked open


def test_a_stream_request_with_a_body_goes_to_the_view_with_its_body(fallbacks):
    worker = WorkerFactory()
    scope, body = _refusals(worker, worker_token(worker), "")["a body"]

    lean = open_and_close(application, scope, body)

    assert lean[0] == 200 and fallbacks == ["GET"]  # the view ignores a GET's body; the lean path hands it on
    assert stream_state(worker) == (None, 0)


def test_the_plain_request_test_refuses_what_django_would_read_otherwise():
    plain = [(TOKEN, b"wt_x")]
    assert stream_endpoint.plain_stream_request(scope_of(headers=plain)) is not None
    assert stream_endpoint.plain_stream_request(scope_of(headers=plain) | {"root_path": "/x"}) is None
    assert stream_endpoint.plain_stream_request(scope_of(headers=[*plain, (b"x-forwarded-host", b"a")])) is None
    assert stream_endpoint.plain_stream_request(scope_of(headers=plain, query=b"\xff")) is None
    with override_settings(SECURE_SSL_REDIRECT=True):
        assert stream_endpoint.plain_stream_request(scope_of(headers=plain)) is None
    with override_settings(DISALLOWED_USER_AGENTS=["curl"]):
        assert stream_endpoint.plain_stream_request(scope_of(headers=plain)) is None


def test_a_wakeup_behaves_as_the_asyncio_event_the_library_waits_on():
    from realtime.listeners import Wakeup

    async def run():
        seen = []
        for event in (asyncio.Event(), Wakeup()):
            waiting = asyncio.ensure_future(event.wait())
            await asyncio.sleep(0)
            before = (event.is_set(), waiting.done())
            event.set()
            woken = await asyncio.wait_for(waiting, 1)
            already = await asyncio.wait_for(event.wait(), 1)  # set: returns at once
            event.clear()
            cancelled = asyncio.ensure_future(event.wait())
            await asyncio.sleep(0)
            cancelled.cancel()
            await asyncio.sleep(0)
            event.set()  # a cancelled waiter is skipped, not an error
            seen.append((before, woken, already, cancelled.cancelled(), event.is_set()))
        return seen

    asyncio_event, wakeup = asyncio.run(run())
    assert wakeup == asyncio_event == ((False, False), True, True, True, True)
