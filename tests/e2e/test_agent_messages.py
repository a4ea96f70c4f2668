"""Issue 14.8 with real agent processes: a wrong scheme, a wrong path or a refused connection is said
within seconds; the agent's --name and --persistent, when they differ from the worker, are shown to
the operator and reconciled (the worker's type wins)."""

import http.server
import ssl
import threading

import pytest

from simpletuner_cli.tls import ensure_self_signed_cert

from .agent_harness import AgentRunner, worker_when, write_import_blocker
from .harness import free_port

pytestmark = pytest.mark.e2e

SAID_WITHIN_S = 12  # a TLS handshake a plain-HTTP server never answers times out after 5 s, then a 3 s probe


@pytest.fixture
def agents(orchestrator, fleet, tmp_path):
    runner = AgentRunner(orchestrator, fleet, tmp_path, blocker_dir=write_import_blocker(tmp_path / "no-django"))
    yield runner
    runner.cleanup()


@pytest.fixture
def https_server(tmp_path):
    """A server that speaks HTTPS (a self-signed certificate) on a local port; yields its port."""
    certfile, keyfile, _ = ensure_self_signed_cert(tmp_path / "tls", "127.0.0.1")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), http.server.BaseHTTPRequestHandler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certfile, keyfile)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


def _fails_with(agent, pattern):
    index = agent.wait_for_line(pattern, timeout=SAID_WITHIN_S)
    line = agent.lines()[index]
    assert agent.wait_exit(timeout=5) == 1, agent.describe()
    assert "Traceback" not in agent.output()
    return line


def test_https_for_a_plain_http_orchestrator_is_said_and_fatal(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    url = orchestrator.base_url.replace("http://", "https://")
    agent = agents.start(worker, orchestrator_url=url)
    line = _fails_with(agent, "speaks plain HTTP, not HTTPS")
    assert f"use --orchestrator-url {orchestrator.base_url}" in line


def test_http_for_an_https_orchestrator_is_said_and_fatal(fleet, agents, https_server):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = agents.start(worker, orchestrator_url=f"http://127.0.0.1:{https_server}")
    line = _fails_with(agent, "speaks HTTPS, not plain HTTP")
    assert f"use --orchestrator-url https://127.0.0.1:{https_server}" in line


def test_a_wrong_path_and_a_refused_connection_are_said_at_once(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    wrong_path = agents.start(worker, orchestrator_url=orchestrator.base_url + "/api")
    _fails_with(wrong_path, "has no worker API (HTTP 404")
    # Under /admin the admin answers the POST with its CSRF page (403): that is no word about the token.
    admin_path = agents.start(worker, orchestrator_url=orchestrator.base_url + "/admin")
    line = _fails_with(admin_path, "has no worker API (HTTP 403")
    assert "rotated" not in line and "pass the orchestrator's base URL" in line
    refused = agents.start(worker, orchestrator_url=f"http://127.0.0.1:{free_port()}")
    refused.wait_for_line("connection refused", timeout=5)
    assert refused.running()  # transient: a persistent agent keeps trying


def test_the_agents_own_name_and_type_are_shown_and_reconciled(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag})  # persistent
    agent = agents.start(worker, persistent=False, extra_args=("--name", "calls-itself-this"))
    index = agent.wait_for_line("set by the operator who created it, and it wins over starting without --persistent")
    line = agent.lines()[index]
    assert "this agent stays online between jobs" in line
    assert 'start it with the token of an ephemeral worker (admin → Workers → Add worker, or POST /api/admin/workers with "worker_type": "ephemeral")' in line
    agent.wait_for_line(f"The orchestrator knows this worker as '{worker.name}', not 'calls-itself-this'")
    state = worker_when(orchestrator, worker.id, lambda w: w["agent_name"] == "calls-itself-this", message="agent name")
    assert state["agent_persistent"] is False
    assert state["agent_notes"] == [
        f"its agent calls itself 'calls-itself-this' (--name); it is registered as '{worker.name}'",
        "its agent was started ephemeral (no --persistent); it follows the worker's type, persistent, and stays online between jobs",
    ]
    page = orchestrator.request("GET", "/admin/")  # (anonymous: the notes are for operators only)
    assert "calls-itself-this" not in page.text
