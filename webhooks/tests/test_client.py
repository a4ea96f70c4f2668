"""The HTTP side against a real receiver on loopback: the connection goes to the address checked, with a deadline."""

import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from .. import client


@pytest.fixture
def receiver():
    """A real HTTP server on 127.0.0.1 recording each request's Host, path and body; answers ``receiver.status``."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            server.seen.append((self.headers["Host"], self.path, body, dict(self.headers)))
            self.send_response(server.status)
            self.send_header("Retry-After", "42")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.seen, server.status = [], 200
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture
def allow_private(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "WEBHOOK_ALLOW_PRIVATE": True}


def test_a_post_reaches_the_receiver_by_the_checked_address_with_its_own_host_name(receiver, resolver, allow_private):
    port = receiver.server_address[1]
    resolver["receiver.test"] = ["127.0.0.1"]
    receiver.status = 503

    answer = client.post(f"http://receiver.test:{port}/hook?x=1", b'{"a": 1}', {"X-SimpleTuner-Event": "job.failed"})

    assert (answer.status_code, answer.retry_after, answer.error) == (503, 42.0, "")
    ((host, path, body, headers),) = receiver.seen
    assert (host, path, body, headers["X-SimpleTuner-Event"]) == (f"receiver.test:{port}", "/hook?x=1", b'{"a": 1}', "job.failed")


def test_a_name_that_resolves_to_a_private_address_at_delivery_is_refused_and_not_connected(receiver, resolver):
    port = receiver.server_address[1]
    resolver["rebound.example.com"] = ["127.0.0.1"]  # public when the webhook was made, loopback now

    answer = client.post(f"http://rebound.example.com:{port}/", b"{}", {})

    assert answer.status_code is None and answer.refused and "loopback" in answer.error
    assert receiver.seen == []


def test_a_name_that_does_not_resolve_is_retried(resolver):
    resolver["gone.example.com"] = socket.gaierror("Name or service not known")

    answer = client.post("https://gone.example.com/", b"{}", {})

    assert answer.status_code is None and not answer.refused and "does not resolve" in answer.error


def test_a_receiver_that_never_answers_is_given_up_at_the_deadline(allow_private):
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        answer = client.post(f"http://127.0.0.1:{silent.getsockname()[1]}/", b"{}", {}, timeout=0.5)
    finally:
        silent.close()

    assert answer.status_code is None and not answer.refused and "0.5 s" in answer.error
    assert 400 <= answer.duration_ms < 3000


def test_a_closed_port_is_a_connection_error(allow_private):
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()

    answer = client.post(f"http://127.0.0.1:{port}/", b"{}", {})

    assert answer.status_code is None and not answer.refused and answer.error
