"""No unauthenticated byte reaches the disk: a request is judged from its head before its body is read, its body is
held to its route's limit as it arrives, and the bodies being spooled stay under one bound (``serving.guard``).

A real server process (``python -m serving``, as ``simpletuner server`` runs daphne), raw sockets for requests
whose bodies are never sent, and the server's own temporary directory, where Twisted spools bodies."""

import json
import socket
import time

import pytest

from worker_agent import protocol

from .harness import Orchestrator, create_database, drop_database

pytestmark = pytest.mark.e2e

SPOOL_MAX = 1536 * 1024  # 1.5 MiB: one API body of 1 MiB fits, two do not
MiB = 1024 * 1024


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
    ],
)
def server(request, tmp_path_factory):
    data_dir = tmp_path_factory.mktemp(f"guard-{request.param}")
    spool_dir = data_dir / "tmp"
    spool_dir.mkdir()
    database_url = redis_url = server_url = None
    if request.param == "postgres":
        from tests.services import require_postgres_url, require_redis_url

        server_url, redis_url = require_postgres_url(), require_redis_url()
        database_url = create_database(server_url)
    orchestrator = Orchestrator(
        backend=request.param, data_dir=data_dir, database_url=database_url, redis_url=redis_url,
        extra_env={"TMPDIR": str(spool_dir), "SIMPLETUNER_SPOOL_MAX_BYTES": str(SPOOL_MAX)},
    ).start()  # fmt: skip
    orchestrator.spool_dir = spool_dir
    yield orchestrator
    orchestrator.stop()
    if database_url:
        drop_database(server_url, database_url)


def connect(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.settimeout(10)
    return sock


def send_head(sock, method, path, headers):
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in headers.items())]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())


def read_answer(sock, *, refused=True):
    """Read one response: ``(status, headers as a dict with lower-case names, JSON body)``, and (for a refusal)
    whether the server then closed the connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    closed = sock.recv(65536) == b"" if refused else None
    return int(status_line.split()[1]), headers, json.loads(body), closed


def spooled_bytes(server):
    return sum(path.stat().st_size for path in server.spool_dir.rglob("*") if path.is_file())


def test_a_tokenless_chunked_heartbeat_is_refused_before_its_body(server):
    with connect(server) as sock:
        send_head(sock, "POST", protocol.HEARTBEAT_PATH, {"Transfer-Encoding": "chunked", "Content-Type": "application/json"})
        status, _, body, closed = read_answer(sock)  # the body was never sent
    assert (status, body["code"], closed) == (401, protocol.NOT_AUTHENTICATED, True)


def test_a_chunked_body_over_the_api_limit_is_refused_as_it_arrives(server):
    with connect(server) as sock:
        send_head(sock, "POST", protocol.HEARTBEAT_PATH,
                  {"Transfer-Encoding": "chunked", "Content-Type": "application/json", protocol.WORKER_TOKEN_HEADER: "wt_x"})  # fmt: skip
        chunk = b"x" * 65536
        try:
            for _ in range(300 * MiB // len(chunk)):
                sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                assert spooled_bytes(server) < 2 * MiB  # what passes the limit is dropped, never spooled
        except OSError:  # the server answered and closed
            pass
        status, _, body, _ = read_answer(sock)
    assert (status, body["code"]) == (413, "request_too_large")


@pytest.mark.parametrize("token", [None, "garbage", "stu_not-a-signed-token"])
def test_an_upload_without_a_signed_upload_token_is_refused_before_its_body(server, token):
    headers = {"Content-Length": str(10 * MiB), "Content-Type": "application/octet-stream"}
    if token:
        headers[protocol.UPLOAD_TOKEN_HEADER] = token
    with connect(server) as sock:
        send_head(sock, "PUT", f"{protocol.UPLOAD_PATH}/bucket/key.bin", headers)
        status, _, body, closed = read_answer(sock)
    assert (status, body["code"], closed) == (401, protocol.NOT_AUTHENTICATED, True)
    assert spooled_bytes(server) == 0


def test_a_declared_length_over_the_routes_limit_is_refused_at_once(server):
    answers = []
    for _ in range(3):
        with connect(server) as sock:
            send_head(sock, "PUT", f"{protocol.UPLOAD_PATH}/b/k", {"Content-Length": str(1024**4)})  # 1 TiB
            answers.append(read_answer(sock))
    assert [(status, body["code"], closed) for status, _, body, closed in answers] == [(413, "request_too_large", True)] * 3
    assert spooled_bytes(server) == 0


def test_past_the_spool_bound_a_new_body_gets_503_with_retry_after(server):
    path, head = "/api/queue/submit", {"Content-Length": str(MiB), "Content-Type": "application/json"}
    holding = connect(server)
    try:
        send_head(holding, "POST", path, head)  # holds 1 MiB of the 1.5 MiB bound while its body is awaited
        holding.sendall(b"{")
        deadline = time.monotonic() + 10
        while True:  # the first head is judged once the server reads it
            with connect(server) as sock:
                send_head(sock, "POST", path, head)
                status, headers, body, closed = read_answer(sock, refused=False)
            if status == 503 or time.monotonic() > deadline:
                break
        assert (status, body["code"], headers["connection"]) == (503, "server_busy", "close")
        assert int(headers["retry-after"]) > 0
    finally:
        holding.close()
    deadline = time.monotonic() + 10
    while True:  # the bound is given back when the holding connection goes
        with connect(server) as sock:
            send_head(sock, "POST", path, {**head, "Content-Length": "2"})
            sock.sendall(b"{}")
            status = read_answer(sock, refused=False)[0]
        if status != 503 or time.monotonic() > deadline:
            break
    assert status == 401  # judged by the API now: no operator token


def test_requests_within_their_limits_are_served_as_before(server):
    response = server.admin("POST", "/api/queue/submit", json={"config_name": "guarded", "config": {"x": 1}})
    assert response.status_code in (201, 202), response.text
