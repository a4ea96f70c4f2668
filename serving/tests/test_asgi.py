"""The ASGI entry point and the static files middleware: no per-step thread hops, same answers."""

import json
import threading

import pytest
from asgiref.sync import async_to_sync, iscoroutinefunction, sync_to_async
from django.conf import settings
from django.core import signals
from django.test import AsyncClient, Client

from common.middleware import StaticFilesMiddleware
from serving.asgi import PooledASGIHandler
from simpletuner_site.asgi import application
from simpletuner_site.tests.asgi_support import asgi_request
from worker_agent import protocol

STATIC_FILE = "/static/simpletuner/admin/admin.css"


async def asgi_get(path, headers=()):
    status, _, body = await asgi_request(application, "GET", path, headers=headers)
    return status, body


def test_the_static_middleware_can_run_sync_and_async():
    assert StaticFilesMiddleware.sync_capable and StaticFilesMiddleware.async_capable


def test_a_static_file_is_served_by_the_sync_chain():
    response = Client().get(STATIC_FILE)
    assert response.status_code == 200
    assert b"".join(response.streaming_content)


def test_a_static_file_is_served_by_an_async_chain():
    response = async_to_sync(AsyncClient().get)(STATIC_FILE)
    assert response.status_code == 200


def test_requests_other_than_streams_enter_one_sync_chain():
    handler = application.requests
    assert isinstance(handler, PooledASGIHandler)
    assert iscoroutinefunction(handler._middleware_chain)  # entered with one hop ...
    # ... and everything inside it is sync: no middleware was adapted to async mode
    assert not any(iscoroutinefunction(m) for m in handler._view_middleware)


@pytest.mark.django_db(transaction=True)
def test_the_api_answers_through_the_sync_chain():
    status, body = async_to_sync(asgi_get)(protocol.QUEUE_PATH)
    assert status in (401, 403)
    assert json.loads(body)["code"]


@pytest.mark.django_db(transaction=True)
def test_an_api_request_runs_on_a_request_thread_and_djangos_signals_are_sent_once_each(monkeypatch):
    from workers.authentication import WorkerTokenAuthentication

    ran, authenticate = [], WorkerTokenAuthentication.authenticate

    def recording(self, request):
        ran.append(("view", threading.current_thread().name))
        return authenticate(self, request)

    def started(sender, **kwargs):
        ran.append(("started", "scope" in kwargs))

    def finished(sender, **kwargs):
        ran.append(("finished", None))

    monkeypatch.setattr(WorkerTokenAuthentication, "authenticate", recording)
    signals.request_started.connect(started)
    signals.request_finished.connect(finished)
    try:
        status, _ = async_to_sync(asgi_get)(protocol.QUEUE_PATH)
    finally:
        signals.request_started.disconnect(started)
        signals.request_finished.disconnect(finished)

    assert status in (401, 403)
    assert [(event, value if event != "view" else value.startswith("request_")) for event, value in ran] == [
        ("started", True),
        ("view", True),
        ("finished", None),
    ], ran


@pytest.mark.django_db(transaction=True)
def test_a_stream_with_a_bad_token_is_refused_through_the_stream_handler():
    status, body = async_to_sync(asgi_get)(protocol.STREAM_PATH, [(protocol.WORKER_TOKEN_HEADER.lower().encode(), b"wt_nope")])
    assert status in (401, 403)
    assert json.loads(body)["code"]


@pytest.mark.django_db(transaction=True)
def test_a_static_file_is_served_through_the_asgi_application():
    status, body = async_to_sync(asgi_get)(STATIC_FILE)
    assert status == 200 and body


def test_requests_run_on_the_fixed_request_threads():
    handler = application.requests
    assert handler.threads._max_workers == settings.REQUEST_THREADS
    names = set()

    def record(request):
        import threading

        names.add(threading.current_thread().name)

    for _ in range(3):
        async_to_sync(sync_to_async(record, thread_sensitive=False, executor=handler.threads))(None)
    assert names and all(n.startswith("request") for n in names)
    assert len(names) <= settings.REQUEST_THREADS


@pytest.mark.django_db(transaction=True)
def test_artifact_transfers_run_on_their_own_threads_and_other_requests_on_the_request_threads(monkeypatch):
    import serving.asgi

    ran, close_old_connections = [], serving.asgi.close_old_connections

    def recording():
        ran.append(threading.current_thread().name.split("_")[0])
        close_old_connections()

    monkeypatch.setattr(serving.asgi, "close_old_connections", recording)  # before and after each request's chain
    for method, path in (
        ("PUT", f"{protocol.UPLOAD_PATH}/bucket/model.bin"),  # an attempt's upload
        ("GET", f"{protocol.UPLOAD_PATH}/bucket/model.bin"),  # its resume download
        ("GET", "/api/artifacts/1/download"),  # an operator's download
        ("GET", protocol.QUEUE_PATH),
        ("POST", protocol.job_status_path("j_1")),
        ("POST", "/admin/login/"),  # a sign-in: password hashing on threads of its own
        ("POST", "/api-auth/login/"),
    ):
        status, _, _ = async_to_sync(asgi_request)(application, method, path)
        assert status in (200, 401, 403), (method, path, status)  # no token: refused, but through the chain

    assert ran == ["transfer"] * 6 + ["request"] * 4 + ["login"] * 4
    handler = application.requests
    assert handler.transfer_threads._max_workers == settings.TRANSFER_THREADS
    assert handler.threads is not handler.transfer_threads


def test_with_the_fast_paths_off_every_request_goes_to_djangos_own_handler(settings):
    from django.core.handlers.asgi import ASGIHandler

    from serving.asgi import FastPathsASGIHandler, QuietASGIHandler, build_application

    settings.FAST_PATHS = False
    off = build_application()
    assert type(off) is QuietASGIHandler and type(off).__mro__[1] is ASGIHandler
    assert set(vars(QuietASGIHandler)) - {"__module__", "__doc__"} == {"listen_for_disconnect"}  # nothing else
    settings.FAST_PATHS = True
    assert type(build_application()) is FastPathsASGIHandler


@pytest.mark.django_db(transaction=True)
def test_with_the_fast_paths_off_the_api_answers_as_with_them_on():
    from serving.asgi import build_application

    answers = [
        async_to_sync(asgi_request)(build_application(fast_paths), "GET", protocol.QUEUE_PATH)
        for fast_paths in (True, False)
    ]
    (status_on, headers_on, body_on), (status_off, headers_off, body_off) = answers
    assert status_on == status_off == 401
    assert body_on == body_off
    assert headers_on == headers_off
