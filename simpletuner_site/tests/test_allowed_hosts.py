"""ALLOWED_HOSTS outside production mode (issue 28): the loopback names, what `simpletuner server --host`
listens on and this machine's own names are answered; any other Host gets 400, on every kind of route."""

import json
import os
import socket
import subprocess
import sys
from unittest import mock

import psutil
import pytest
import requests
from asgiref.sync import async_to_sync
from cryptography import x509
from django.http.request import validate_host
from django.test import override_settings

from simpletuner_cli import tls
from simpletuner_cli.tests.test_cli import START_DEADLINE_S, _api_token, start_server  # noqa: F401 (a fixture)
from simpletuner_site.asgi import application
from simpletuner_site.settings import LOOPBACK_ALLOWED_HOSTS
from simpletuner_site.tests.asgi_support import asgi_exchange
from tests.e2e.harness import REPO_ROOT, poll
from worker_agent import protocol
from workers.models import Worker, WorkerStatus
from workers.tests.factories import WorkerFactory, worker_token

FORGED = "rebound.attacker.example"
PORT = 8001

# `simpletuner server ARGV` up to Django's set-up (nothing is listened on): prints settings.ALLOWED_HOSTS.
CLI_PROBE = """
import json, sys
from unittest import mock
import django
from simpletuner_cli import serve
from simpletuner_cli.main import main

real_setup = django.setup

def setup_and_report():
    real_setup()
    from django.conf import settings
    print(json.dumps(settings.ALLOWED_HOSTS))
    raise SystemExit(0)

with mock.patch.object(serve, "refuse_port_in_use"), mock.patch.object(django, "setup", setup_and_report):
    main(sys.argv[1:])
"""
# Django set up as manage.py and daphne do it (no CLI): prints settings.ALLOWED_HOSTS.
PLAIN_PROBE = "import json, django; django.setup(); from django.conf import settings; print(json.dumps(settings.ALLOWED_HOSTS))"


def allowed_hosts(tmp_path, *argv, **env):
    """Return settings.ALLOWED_HOSTS in a fresh process (no DJANGO_*/SIMPLETUNER_* variables but ``env``):
    of `simpletuner server ARGV`, or of a plain Django set-up without ``argv``."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO_", "SIMPLETUNER_"))}
    clean.pop("DATABASE_URL", None)
    clean.pop("REDIS_URL", None)
    clean.update(SIMPLETUNER_DATA_DIR=str(tmp_path / "data"), DJANGO_SETTINGS_MODULE="simpletuner_site.settings", **env)
    code = ["-c", CLI_PROBE, "server", *argv] if argv else ["-c", PLAIN_PROBE]
    result = subprocess.run([sys.executable, *code], cwd=REPO_ROOT, env=clean, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def entry(address):
    """Return ``address`` as it stands in ALLOWED_HOSTS (an IPv6 address bracketed, without its zone)."""
    address = address.split("%", 1)[0].lower()
    return f"[{address}]" if ":" in address else address


def interface_addresses():
    families = (socket.AF_INET, socket.AF_INET6)
    return {entry(a.address) for addrs in psutil.net_if_addrs().values() for a in addrs if a.family in families}


def all_allowed(names, hosts):
    """Return the names of ``names`` that Django would refuse under ALLOWED_HOSTS ``hosts`` (none: all allowed)."""
    return {name for name in names if not validate_host(name, hosts)}


def machine_names():
    hostname = socket.gethostname()
    return {entry(hostname), entry(socket.getfqdn())} | {entry(info[4][0]) for info in socket.getaddrinfo(hostname, None)}


# --- the default, in a fresh process -----------------------------------------------------------------


def test_the_default_is_the_loopback_names_and_this_machines_names(tmp_path):
    hosts = allowed_hosts(tmp_path)

    assert hosts[: len(LOOPBACK_ALLOWED_HOSTS)] == [".localhost", "127.0.0.1", "[::1]"]
    assert all_allowed(machine_names(), hosts) == set()
    assert "*" not in hosts and not validate_host("10.1.2.3", hosts) and not validate_host(FORGED, hosts)


def test_the_servers_host_is_added(tmp_path):
    assert "10.1.2.3" in allowed_hosts(tmp_path, "--host", "10.1.2.3", "--no-local-worker")
    assert "10.1.2.3" not in allowed_hosts(tmp_path, "--no-local-worker")  # the default --host: loopback only


def test_a_wildcard_host_adds_every_interface_address(tmp_path):
    hosts = allowed_hosts(tmp_path, "--host", "0.0.0.0")

    assert all_allowed(interface_addresses() | machine_names(), hosts) == set()
    assert not validate_host(FORGED, hosts)


def test_the_name_the_local_worker_dials_is_added(tmp_path):
    """A supplied certificate that covers neither the address nor localhost: the local worker dials its name."""
    with mock.patch.object(tls, "_subject_alt_names", return_value=[x509.DNSName("orch.internal")]):
        cert_path, key_path, _ = tls.ensure_self_signed_cert(tmp_path / "tls", "0.0.0.0")

    hosts = allowed_hosts(tmp_path, "--host", "0.0.0.0", "--ssl-certfile", str(cert_path), "--ssl-keyfile", str(key_path))

    assert "orch.internal" in hosts


def test_the_public_urls_host_is_added(tmp_path):
    assert "orch.example.com" in allowed_hosts(tmp_path, SIMPLETUNER_PUBLIC_URL="https://Orch.Example.com:8443")


def test_an_explicit_django_allowed_hosts_wins(tmp_path):
    hosts = allowed_hosts(tmp_path, "--host", "10.1.2.3", DJANGO_ALLOWED_HOSTS="orch.example.com, *.lan.example")

    assert hosts == ["orch.example.com", "*.lan.example"]


# --- requests through the ASGI application (fast paths first), under the default -----------------------


@pytest.fixture(scope="module")
def default_hosts(tmp_path_factory):
    return allowed_hosts(tmp_path_factory.mktemp("hosts"))


@pytest.fixture
def default_allowed_hosts(default_hosts):
    with override_settings(ALLOWED_HOSTS=default_hosts, PUBLIC_URL=""):
        yield default_hosts


def request(method, path, *, host, body=None, token=None):
    """Send one request to the ASGI application with ``Host: host:PORT``; return ``(status, body)``."""
    raw = b"" if body is None else json.dumps(body).encode()
    headers = [(b"host", f"{host}:{PORT}".encode()), (b"accept", b"application/json")]
    if body is not None:
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if token is not None:
        headers.append((protocol.WORKER_TOKEN_HEADER.lower().encode(), token.encode()))
    path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": headers, "client": ("192.0.2.77", 40000), "server": ("127.0.0.1", PORT)}
    start, out = async_to_sync(asgi_exchange)(application, scope, body=raw)
    return start["status"], out


def host_name():
    return socket.gethostname().lower()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", "/api/queue/"), ("GET", "/admin/login/"), ("POST", protocol.REGISTER_PATH), ("POST", protocol.QUEUE_PATH)],
    ids=["api", "admin", "register", "queue"],
)
def test_a_forged_host_gets_400_where_the_machines_name_is_answered(default_allowed_hosts, method, path):
    worker = WorkerFactory()
    token = worker_token(worker)
    body = {} if method == "POST" else None

    forged, _ = request(method, path, host=FORGED, body=body, token=token)
    answered, _ = request(method, path, host=host_name(), body=body, token=token)

    assert forged == 400
    assert answered in (200, 401)  # the API wants an operator's credentials; the rest are answered


@pytest.mark.django_db(transaction=True)
def test_a_heartbeat_with_a_forged_host_gets_400_and_records_nothing(default_allowed_hosts):
    worker = WorkerFactory(status=WorkerStatus.IDLE, stream_id="s1")
    token = worker_token(worker)
    before = Worker.objects.get(pk=worker.pk).last_heartbeat

    forged, _ = request("POST", protocol.HEARTBEAT_PATH, host=FORGED, body={"status": protocol.AGENT_IDLE}, token=token)

    assert forged == 400
    assert Worker.objects.get(pk=worker.pk).last_heartbeat == before
    answered, body = request("POST", protocol.HEARTBEAT_PATH, host=host_name(), body={"status": protocol.AGENT_IDLE}, token=token)
    assert answered == 200, body
    assert Worker.objects.get(pk=worker.pk).last_heartbeat != before


@pytest.mark.django_db(transaction=True)
def test_a_stream_with_a_forged_host_gets_400(default_allowed_hosts):
    worker = WorkerFactory()

    status, _ = request("GET", f"{protocol.STREAM_PATH}?worker_id={worker.pk}", host=FORGED, token=worker_token(worker))

    assert status == 400


@pytest.mark.django_db(transaction=True)
def test_a_registration_by_the_machines_name_gets_a_stream_url_of_that_name(default_allowed_hosts):
    worker = WorkerFactory()

    status, body = request("POST", protocol.REGISTER_PATH, host=host_name(), body={"name": worker.name}, token=worker_token(worker))

    assert status == 200, body
    assert json.loads(body)["sse_url"] == f"http://{host_name()}:{PORT}{protocol.STREAM_PATH}?worker_id={worker.pk}"


# --- a real server on every interface, an agent dialling the machine's address -------------------------


def outside_address():
    """Return one of this machine's IPv4 addresses that is not loopback, or None."""
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


@pytest.mark.e2e
def test_an_agent_dialling_the_machines_address_connects_and_a_forged_host_is_refused(start_server, tmp_path):
    address = outside_address()
    if address is None:
        pytest.skip("this machine has no IPv4 address besides loopback")
    data_dir = tmp_path / "data"
    server = start_server("--host", "0.0.0.0", "--no-local-worker", data_dir=data_dir, env={"DJANGO_ALLOWED_HOSTS": None})
    base = f"http://{address}:{server.port}"
    server.wait_until_unauthorized(f"{base}/api/admin/workers")
    forged = requests.get(f"{base}/api/admin/workers", headers={"Host": f"{FORGED}:{server.port}"}, timeout=10)
    assert forged.status_code == 400
    admin = {"Authorization": f"Bearer {_api_token(data_dir)}"}
    created = requests.post(f"{base}/api/admin/workers", json={"name": "by-address"}, headers=admin, timeout=10)
    assert created.status_code == 201, created.text
    worker_id, token = created.json()["id"], created.json()["token"]

    registered = requests.post(f"{base}{protocol.REGISTER_PATH}", json={"name": "by-address"},
                               headers={protocol.WORKER_TOKEN_HEADER: token}, timeout=10)
    assert registered.status_code == 200, registered.text
    assert registered.json()["sse_url"] == f"{base}{protocol.STREAM_PATH}?worker_id={worker_id}"

    env = {**os.environ, "SIMPLETUNER_WORKER_TOKEN": token, "SIMPLETUNER_WORK_DIR": str(tmp_path / "jobs")}
    agent_log = tmp_path / "agent.log"
    with open(agent_log, "wb") as log:
        agent = subprocess.Popen([sys.executable, "-m", "worker_agent", "--orchestrator-url", base, "--name", "by-address"],
                                 cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        def connected():
            worker = requests.get(f"{base}/api/admin/workers/{worker_id}", headers=admin, timeout=10).json()
            return worker["status"] == WorkerStatus.IDLE and worker["stream_connected"]

        try:
            poll(connected, timeout=START_DEADLINE_S, message="the agent connected by the machine's address")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{agent_log.read_text(errors='replace')}") from None
    finally:
        agent.terminate()
        agent.wait(timeout=30)
