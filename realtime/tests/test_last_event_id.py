"""A malformed Last-Event-ID (header or ``?lastEventId=``) is a 400 ``invalid_last_event_id`` on the worker stream
and on the operator feed: real ASGI requests through the served application, lean stream path included."""

import json
from urllib.parse import urlencode

import pytest
from asgiref.sync import async_to_sync
from django.test import Client

from realtime.operator_feed import OPERATOR_FEED_PATH
from realtime.resume import resume_from
from simpletuner_site.asgi import application
from simpletuner_site.tests.asgi_support import asgi_exchange
from worker_agent import protocol
from workers.models import Worker
from workers.tests.factories import UserFactory, WorkerFactory, worker_token

pytestmark = pytest.mark.django_db(transaction=True)  # the stream and the feed read the database in threads of their own

TOKEN = protocol.WORKER_TOKEN_HEADER.lower().encode()
MALFORMED = ["worker-{id}:abc", ":1.5", ":", "worker-{id}:", "worker-{id}:-1", "worker-{id}:1,:2", "worker-{id}", "a:b:c"]


def _scope(path, *, headers, query=""):
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
            "headers": [(b"host", b"testserver"), *headers], "client": ("127.0.0.1", 1234),
            "server": ("testserver", 80)}


def _answer(scope):
    start, body = async_to_sync(asgi_exchange)(application, scope)
    return start["status"], json.loads(body)


@pytest.mark.parametrize("where", ["header", "query"])
@pytest.mark.parametrize("malformed", MALFORMED)
def test_the_worker_stream_refuses_a_malformed_last_event_id_and_opens_nothing(malformed, where):
    worker = WorkerFactory(stream_id=None, open_streams=[])
    value = malformed.format(id=worker.pk)
    headers = [(TOKEN, worker_token(worker).encode())]
    if where == "header":
        headers.append((b"last-event-id", value.encode()))
    query = urlencode({"lastEventId": value}) if where == "query" else ""

    status, body = _answer(_scope(protocol.STREAM_PATH, headers=headers, query=query))

    assert (status, body["code"]) == (400, "invalid_last_event_id")
    assert "whole number" in body["detail"]
    worker.refresh_from_db()
    assert (worker.stream_id, worker.open_streams) == (None, [])


@pytest.mark.parametrize("where", ["header", "query"])
@pytest.mark.parametrize("malformed", ["worker-w_1:abc", ":1.5", ":"])
def test_the_operator_feed_refuses_a_malformed_last_event_id(malformed, where):
    browser = Client()
    browser.force_login(UserFactory(is_staff=True, permissions=["workers.view_worker"]))
    headers = [(b"cookie", f"sessionid={browser.cookies['sessionid'].value}".encode())]
    if where == "header":
        headers.append((b"last-event-id", malformed.encode()))
    query = urlencode({"lastEventId": malformed}) if where == "query" else ""

    status, body = _answer(_scope(OPERATOR_FEED_PATH, headers=headers, query=query))

    assert (status, body["code"]) == (400, "invalid_last_event_id")


def test_a_well_formed_last_event_id_is_read_whole():
    assert resume_from("worker-w_1:7,worker-w%2F2:0", []) == {"worker-w_1": "7", "worker-w/2": "0"}
    assert resume_from(None, ["worker-w_1:3", ""]) == {"worker-w_1": "3"}
    assert resume_from(None, []) == {}


def test_the_stream_still_opens_when_the_last_event_id_is_well_formed():
    worker = WorkerFactory(stream_id=None, open_streams=[])
    headers = [(TOKEN, worker_token(worker).encode()), (b"last-event-id", f"worker-{worker.pk}:0".encode())]
    scope = _scope(protocol.STREAM_PATH, headers=headers)

    async def open_and_hang_up():
        from asgiref.testing import ApplicationCommunicator

        comm = ApplicationCommunicator(application, scope)
        await comm.send_input({"type": "http.request", "body": b"", "more_body": False})
        start = await comm.receive_output(10)
        await comm.send_input({"type": "http.disconnect"})
        await comm.wait(10)
        return start["status"]

    assert async_to_sync(open_and_hang_up)() == 200
    assert Worker.objects.get(pk=worker.pk).open_streams == []  # marked closed again when the client went
