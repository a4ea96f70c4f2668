"""Issue 14.7 with real processes: a port in use is one clear line and a non-zero exit; SIGTERM with open
worker streams exits cleanly within seconds, with no traceback; a browser at / finds a landing page and
its favicon request is answered."""

import signal
import socket
import subprocess
import sys
import time

import pytest

from .harness import REPO_ROOT, Fleet, Orchestrator, poll

pytestmark = pytest.mark.e2e

SHUTDOWN_S = 8


def test_a_port_in_use_is_one_clear_line_and_a_non_zero_exit(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "simpletuner_cli", "server", "--port", str(port), "--no-local-worker", "--no-migrate"],
            cwd=REPO_ROOT,
            env={**Orchestrator(backend="sqlite", data_dir=tmp_path).env()},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 1
    assert time.monotonic() - started < 30
    assert result.stdout == ""  # not even the banner: nothing started
    assert result.stderr.splitlines() == [
        f"simpletuner server: error: port {port} on 127.0.0.1 is already in use (another orchestrator?): "
        "stop it, or choose another port with --port N (make run PORT=N)"
    ]


class WithLocalWorker(Orchestrator):
    """``simpletuner server`` as ``make run`` starts it: with the built-in local worker (and its stream)."""

    def _server_argv(self, port):
        return [sys.executable, "-m", "simpletuner_cli", "server", "--host", "127.0.0.1", "--port", str(port), "--no-migrate"]


def test_sigterm_with_open_streams_exits_cleanly_within_seconds(tmp_path):
    server = WithLocalWorker(backend="sqlite", data_dir=tmp_path / "data", via_cli=True).start()
    try:
        poll(lambda: "Waiting for jobs" in server.read_log(), timeout=30, message="the local worker to connect")
        poll(lambda: "stream opened for worker" in server.read_log(), timeout=10, message="the local worker's stream")
        fleet = Fleet(server, "sigterm")
        workers = [fleet.create_worker(labels={"pool": "sigterm"}) for _ in range(2)]
        for worker in workers:
            worker.register()
        streams = [fleet.open_stream(worker) for worker in workers] + [fleet.open_stream(workers[0])]
        offset = server.log_size()

        process = server.process
        process.send_signal(signal.SIGTERM)
        started = time.monotonic()
        process.wait(timeout=SHUTDOWN_S)
        took = time.monotonic() - started
        server.process = None
    finally:
        server.stop()
    log = server.read_log(offset)
    assert process.returncode == 0, log
    assert took < SHUTDOWN_S, log
    assert "Traceback" not in log and "RequestAborted" not in log and "never retrieved" not in log, log
    for stream in streams:
        assert stream.wait_closed(timeout=5) != "closed by client"


def test_the_root_is_a_landing_page_and_the_favicon_is_served(orchestrator):
    page = orchestrator.request("GET", "/")
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    for link in ('href="/admin/"', 'href="/api/queue/"', 'href="/api/docs/"', 'href="/api/schema/"'):
        assert link in page.text, link
    icon = orchestrator.request("GET", "/favicon.ico")
    assert icon.status_code == 200 and icon.headers["Content-Type"] == "image/svg+xml"
    assert icon.text.startswith("<svg")
    admin_login = orchestrator.request("GET", "/admin/login/")
    assert 'href="/favicon.ico"' in admin_login.text
