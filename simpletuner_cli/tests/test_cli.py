"""Tests for the `simpletuner` console script, the packaging metadata and the Celery app."""

import hashlib
import ipaddress
import os
import re
import shlex
import socket
import sqlite3
import ssl
import stat
import subprocess
import sys
import tomllib
from datetime import datetime, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import requests
from cryptography import x509

from simpletuner_cli import endpoints, serve, tls
from simpletuner_cli.errors import CLIError
from simpletuner_cli.main import build_parser, main
from tests.e2e.harness import REPO_ROOT, free_port, poll

START_DEADLINE_S = 60
STOP_GRACE_S = 10
FINGERPRINT = re.compile(r"SHA-256\s+((?:[0-9A-F]{2}:){31}[0-9A-F]{2})")


# --- the server process -----------------------------------------------------------------------
class ServerProcess:
    """A `python -m simpletuner_cli server ...` subprocess with its output in a log file."""

    def __init__(self, args, *, data_dir, log_path, env=None):
        self.port = free_port()
        self.data_dir = data_dir
        self.log_path = log_path
        # The server under test is the embedded default: it must not pick up the suite's PostgreSQL/Redis.
        # ``env`` adds variables to its environment; a value of None removes one.
        extra = env or {}
        removed = {"DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE"} | {k for k, v in extra.items() if v is None}
        env = {k: v for k, v in os.environ.items() if k not in removed}
        env.update({k: v for k, v in extra.items() if v is not None})
        env.update(SIMPLETUNER_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "simpletuner_cli", "server", "--port", str(self.port), *args],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def log(self):
        return self.log_path.read_text(errors="replace")

    def wait_until_unauthorized(self, url, **kwargs):
        """Poll ``url`` until it answers 401: the API is up and wants credentials."""
        last = ["no attempt"]

        def answered():
            assert self.process.poll() is None, f"server exited with {self.process.returncode}:\n{self.log()}"
            try:
                response = requests.get(url, timeout=(1, 5), **kwargs)
            except (requests.RequestException, OSError) as exc:  # OSError: the CA file is not written yet
                last[0] = f"{type(exc).__name__}: {exc}"
                return None
            last[0] = f"HTTP {response.status_code}"
            return response.status_code == 401

        try:
            poll(answered, timeout=START_DEADLINE_S, message=f"401 from {url}")
        except AssertionError as exc:
            raise AssertionError(f"{exc} (last: {last[0]})\n{self.log()}") from None

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=STOP_GRACE_S)


@pytest.fixture
def start_server(tmp_path):
    """Return ``start(*args, data_dir=...)``; every server started is stopped after the test."""
    servers = []

    def start(*args, data_dir, env=None):
        server = ServerProcess(args, data_dir=data_dir, log_path=tmp_path / f"server-{len(servers)}.log", env=env)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def _tables(db_path):
    with sqlite3.connect(db_path) as conn:
        return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


# --- end to end -------------------------------------------------------------------------------
@pytest.mark.e2e
def test_server_applies_migrations_and_serves_the_api(start_server, tmp_path):
    data_dir = tmp_path / "data"
    server = start_server(data_dir=data_dir)

    server.wait_until_unauthorized(f"http://127.0.0.1:{server.port}/api/admin/workers")

    db_path = data_dir / "orchestrator.sqlite3"
    with sqlite3.connect(db_path) as conn:
        migrated = {row[0] for row in conn.execute("SELECT DISTINCT app FROM django_migrations")}
    assert {"auth", "workers", "queue", "audit"} <= migrated  # app labels
    log = server.log()
    assert f"http://127.0.0.1:{server.port}" in log
    assert str(data_dir.resolve()) in log
    assert f"SQLite {db_path.resolve()}" in log
    assert "embedded" in log


@pytest.mark.e2e
def test_no_migrate_leaves_a_fresh_database_without_tables(start_server, tmp_path):
    data_dir = tmp_path / "data"
    server = start_server("--no-migrate", data_dir=data_dir)

    server.wait_until_unauthorized(f"http://127.0.0.1:{server.port}/api/admin/workers")

    db_path = data_dir / "orchestrator.sqlite3"
    assert not db_path.exists() or "django_migrations" not in _tables(db_path)


@pytest.mark.e2e
def test_ssl_generates_a_certificate_once_and_serves_https_with_it(start_server, tmp_path):
    data_dir = tmp_path / "data"
    cert_path, key_path = data_dir / "tls" / "cert.pem", data_dir / "tls" / "key.pem"
    first = start_server("--ssl", data_dir=data_dir)

    first.wait_until_unauthorized(f"https://localhost:{first.port}/api/admin/workers", verify=str(cert_path))

    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    der = ssl.PEM_cert_to_DER_cert(cert_path.read_text())
    printed = FINGERPRINT.search(first.log())
    assert printed, first.log()
    assert printed.group(1).replace(":", "").lower() == hashlib.sha256(der).hexdigest()
    assert f"https://127.0.0.1:{first.port}" in first.log()
    # The IP address SAN verifies too, and so does a client in strict X.509 mode (Python 3.13's default).
    by_ip = requests.get(f"https://127.0.0.1:{first.port}/api/admin/workers", verify=str(cert_path), timeout=5)
    assert by_ip.status_code == 401
    context = ssl.create_default_context(cafile=str(cert_path))
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    with socket.create_connection(("127.0.0.1", first.port), timeout=5) as sock:
        with context.wrap_socket(sock, server_hostname="localhost") as tls:
            assert tls.getpeercert(binary_form=True) == der
    cert_bytes = cert_path.read_bytes()
    first.stop()

    second = start_server("--ssl", data_dir=data_dir)
    second.wait_until_unauthorized(f"https://localhost:{second.port}/api/admin/workers", verify=str(cert_path))

    assert cert_path.read_bytes() == cert_bytes
    assert FINGERPRINT.search(second.log()).group(1) == printed.group(1)

    # Served over TLS: HSTS, and the admin's cookies are Secure.
    login = requests.get(f"https://localhost:{second.port}/admin/login/", verify=str(cert_path), timeout=5)
    assert login.status_code == 200
    assert login.headers["Strict-Transport-Security"].startswith("max-age=31536000")
    assert "; secure" in login.headers["Set-Cookie"].lower()
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700  # the database, secret key and TLS key: owner only


def _local_workers(db_path):
    with sqlite3.connect(db_path) as conn:
        return conn.execute("SELECT id, name, status FROM workers_worker WHERE worker_type = 'local'").fetchall()


def _audit_actions(db_path, target_id):
    with sqlite3.connect(db_path) as conn:
        rows = conn.execute("SELECT action FROM audit_auditevent WHERE target_id = ? ORDER BY id", (target_id,))
        return [action for (action,) in rows]


def _agents_of(server):
    return [
        child
        for child in psutil.Process(server.process.pid).children()
        if "worker_agent" in child.cmdline()
    ]


def _gone(process):
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.e2e
def test_server_runs_the_local_worker_and_takes_it_down_with_it(start_server, tmp_path):
    data_dir = tmp_path / "data"
    db_path = data_dir / "orchestrator.sqlite3"
    server = start_server(data_dir=data_dir)
    server.wait_until_unauthorized(f"http://127.0.0.1:{server.port}/api/admin/workers")

    [(worker_id, name, _)] = _wait_for_idle_local_worker(server, db_path)
    token_path = data_dir / "local-worker.token"
    token = token_path.read_text().strip()
    [agent] = _agents_of(server)
    log = server.log()
    assert name == f"local@{socket.gethostname()}"
    assert f"  Local worker {name} (jobs with target local/auto" in log
    assert "[local worker] " in log and token not in log
    assert stat.S_IMODE(token_path.stat().st_mode) == 0o600
    assert token not in " ".join(agent.cmdline())
    assert agent.cmdline()[agent.cmdline().index("--orchestrator-url") + 1] == f"http://127.0.0.1:{server.port}"

    server.stop()

    poll(lambda: _gone(agent), timeout=STOP_GRACE_S, message="the agent to stop with its server")
    # The agent was stopped while the server still answered: its goodbye was heard.
    assert "worker.disconnected" in _audit_actions(db_path, worker_id), server.log()
    assert _local_workers(db_path)[0][2] == "offline"


@pytest.mark.e2e
def test_the_local_worker_and_its_trainer_die_with_a_server_killed_9(start_server, tmp_path):
    data_dir = tmp_path / "data"
    trainer = shlex.join([sys.executable, "-m", "worker_agent.example_trainer"])
    server = start_server(data_dir=data_dir, env={"SIMPLETUNER_WORKER_COMMAND": trainer})
    base = f"http://127.0.0.1:{server.port}"
    server.wait_until_unauthorized(f"{base}/api/admin/workers")
    _wait_for_idle_local_worker(server, data_dir / "orchestrator.sqlite3")
    [agent] = _agents_of(server)
    token = _api_token(data_dir)
    submitted = requests.post(
        f"{base}/api/queue/submit",
        json={"config_name": "long", "target": "local", "config": {"max_train_steps": 10_000, "step_delay": 0.05}},
        headers={"Authorization": f"Bearer {token}"},
        timeout=10,
    )
    assert submitted.status_code == 201, submitted.text
    # The trainer runs under its supervisor (worker_agent/supervisor.py): both descend from the agent.
    job_processes = poll(
        lambda: (found if len(found := agent.children(recursive=True)) >= 2 else None),
        timeout=20,
        message="the trainer and its supervisor to start",
    )

    server.process.kill()  # no chance to stop its local worker
    server.process.wait(timeout=STOP_GRACE_S)

    # A busy agent would finish its job on SIGTERM; without its server it could report nothing, so the
    # kernel kills it with its parent, and its trainer with it.
    poll(
        lambda: _gone(agent) and all(_gone(process) for process in job_processes),
        timeout=STOP_GRACE_S,
        message="the local worker, the trainer and its supervisor to die",
    )


def _api_token(data_dir):
    """Return a new superuser API token for the server whose data lives in ``data_dir``."""
    env = {**os.environ, "SIMPLETUNER_DATA_DIR": str(data_dir)}
    for name in ("DATABASE_URL", "REDIS_URL"):
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "manage.py", "create_api_token", "admin", "--superuser"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=True, timeout=60,
    )
    return out.stdout.strip().splitlines()[-1]


def _wait_for_idle_local_worker(server, db_path, timeout=START_DEADLINE_S):
    def idle_local_worker():
        rows = _local_workers(db_path)
        return rows if rows and rows[0][2] == "idle" else None

    try:
        return poll(idle_local_worker, timeout=timeout, message="the local worker idle")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{server.log()}") from None


def _check_local_worker_over_tls(start_server, tmp_path, env):
    data_dir = tmp_path / "data"
    cert_path = data_dir / "tls" / "cert.pem"
    server = start_server("--ssl", "--host", "0.0.0.0", data_dir=data_dir, env=env)
    server.wait_until_unauthorized(f"https://localhost:{server.port}/api/admin/workers", verify=str(cert_path))

    _wait_for_idle_local_worker(server, data_dir / "orchestrator.sqlite3", timeout=20)  # the server is up already

    [agent] = _agents_of(server)
    argv = agent.cmdline()
    assert argv[argv.index("--orchestrator-url") + 1] == f"https://127.0.0.1:{server.port}"
    assert argv[argv.index("--ca-cert") + 1] == str(cert_path)
    assert "--ssl-no-verify" not in argv


@pytest.mark.e2e
def test_local_worker_trusts_the_generated_certificate(start_server, tmp_path):
    _check_local_worker_over_tls(start_server, tmp_path, {"REQUESTS_CA_BUNDLE": None, "CURL_CA_BUNDLE": None})


@pytest.mark.e2e
def test_local_worker_trusts_the_generated_certificate_despite_a_ca_bundle_variable(start_server, tmp_path):
    import certifi

    _check_local_worker_over_tls(start_server, tmp_path, {"REQUESTS_CA_BUNDLE": certifi.where()})


@pytest.mark.e2e
def test_one_local_worker_per_data_dir_and_none_when_disabled(start_server, tmp_path):
    data_dir = tmp_path / "data"
    first = start_server(data_dir=data_dir)
    first.wait_until_unauthorized(f"http://127.0.0.1:{first.port}/api/admin/workers")
    second = start_server(data_dir=data_dir)
    second.wait_until_unauthorized(f"http://127.0.0.1:{second.port}/api/admin/workers")
    disabled = start_server("--no-local-worker", data_dir=tmp_path / "other")
    disabled.wait_until_unauthorized(f"http://127.0.0.1:{disabled.port}/api/admin/workers")

    poll(lambda: "local worker: another server process on this data dir runs it" in second.log(), timeout=10)
    assert len(_agents_of(first)) == 1 and _agents_of(second) == []
    assert "  Local worker disabled (--no-local-worker" in disabled.log()
    assert _agents_of(disabled) == []
    assert _local_workers(tmp_path / "other" / "orchestrator.sqlite3") == []
    assert not (tmp_path / "other" / "local-worker.token").exists()


def test_certfile_without_keyfile_is_a_one_line_error(tmp_path):
    cert_path, _ = _write_pair(tmp_path, "localhost")
    env = {**os.environ, "SIMPLETUNER_DATA_DIR": str(tmp_path / "data")}

    result = subprocess.run(
        [sys.executable, "-m", "simpletuner_cli", "server", "--ssl-certfile", str(cert_path)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )

    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "--ssl-keyfile" in result.stderr
    assert not (tmp_path / "data").exists()  # refused before Django (and its data dir) was touched


# --- argument handling (in process) -----------------------------------------------------------
@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], "required: COMMAND"),
        (["server", "--port", "0"], "port must be 1-65535"),
        (["server", "--port", "http"], "not a port number"),
        (["server", "--host", "bad host"], "not an address or host name"),
        (["server", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_arguments_are_one_line_errors(capsys, argv, expected):
    with pytest.raises(SystemExit) as exited:
        main(argv)

    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert expected in err


def test_missing_cert_file_is_a_one_line_error(capsys, tmp_path):
    _, key_path = _write_pair(tmp_path, "localhost")

    status = main(["server", "--ssl-certfile", str(tmp_path / "nope.pem"), "--ssl-keyfile", str(key_path)])

    assert status == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.pem: no such file" in err


def test_key_of_another_certificate_is_refused(capsys, tmp_path):
    cert_path, _ = _write_pair(tmp_path / "a", "localhost")
    _, other_key = _write_pair(tmp_path / "b", "localhost")

    status = main(["server", "--ssl-certfile", str(cert_path), "--ssl-keyfile", str(other_key)])

    assert status == 2
    assert "is not the key of --ssl-certfile" in capsys.readouterr().err


def test_encrypted_key_is_refused(capsys, tmp_path):
    cert_path, key_path = _write_pair(tmp_path, "localhost")
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"hunter2"),
        )
    )

    status = main(["server", "--ssl-certfile", str(cert_path), "--ssl-keyfile", str(key_path)])

    assert status == 2
    assert "not an unencrypted PEM private key" in capsys.readouterr().err


# --- the self-signed certificate --------------------------------------------------------------
def _write_pair(directory, host):
    cert_path, key_path, _ = tls.ensure_self_signed_cert(Path(directory) / "tls", host)
    return cert_path, key_path


def test_generated_certificate_names_this_machine_and_the_listen_address(tmp_path):
    cert_path, key_path, created = tls.ensure_self_signed_cert(tmp_path / "tls", "10.1.2.3")

    assert created
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(san.get_values_for_type(x509.DNSName)) >= {"localhost", socket.gethostname()}
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
        ipaddress.ip_address("10.1.2.3"),
    }
    assert timedelta(days=824) < cert.not_valid_after_utc - datetime.now(timezone.utc) <= timedelta(days=825)
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert stat.S_IMODE(cert_path.parent.stat().st_mode) == 0o700
    assert list(tmp_path.iterdir()) == [tmp_path / "tls"]  # no staging directory left behind


def test_wildcard_listen_address_is_not_put_in_the_certificate(tmp_path):
    cert_path, _, _ = tls.ensure_self_signed_cert(tmp_path / "tls", "0.0.0.0")

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("0.0.0.0") not in san.get_values_for_type(x509.IPAddress)


def test_existing_certificate_is_reused(tmp_path):
    cert_path, _, _ = tls.ensure_self_signed_cert(tmp_path / "tls", "localhost")
    before = cert_path.read_bytes()

    again = tls.ensure_self_signed_cert(tmp_path / "tls", "10.9.9.9")

    assert again == (cert_path, tmp_path / "tls" / "key.pem", False)
    assert cert_path.read_bytes() == before


def test_half_a_pair_is_an_error_not_overwritten(tmp_path):
    cert_path, key_path, _ = tls.ensure_self_signed_cert(tmp_path / "tls", "localhost")
    key_path.unlink()

    with pytest.raises(CLIError, match="only one of cert.pem and key.pem"):
        tls.ensure_self_signed_cert(tmp_path / "tls", "localhost")
    assert cert_path.exists() and not key_path.exists()


def test_fingerprint_is_colon_separated_sha256_of_der(tmp_path):
    cert_path, _ = _write_pair(tmp_path, "localhost")
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())

    fingerprint = tls.cert_fingerprint(cert)

    assert re.fullmatch(r"(?:[0-9A-F]{2}:){31}[0-9A-F]{2}", fingerprint)
    assert (
        fingerprint.replace(":", "").lower()
        == hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert_path.read_text())).hexdigest()
    )


# --- endpoints, URLs and the banner -----------------------------------------------------------
@pytest.mark.parametrize(
    "host, kwargs, expected",
    [
        ("127.0.0.1", {}, "tcp:port=8001:interface=127.0.0.1:backlog=1024"),
        ("::1", {}, r"tcp:port=8001:interface=\:\:1:backlog=1024"),
        (
            "::",
            {"certfile": Path("/d/c:rt.pem"), "keyfile": Path("/d/k=y.pem")},
            r"ssl:port=8001:interface=\:\::backlog=1024:privateKey=/d/k\=y.pem:certKey=/d/c\:rt.pem",
        ),
    ],
)
def test_endpoint_string_escapes_colons(host, kwargs, expected):
    assert endpoints.endpoint_string(host, 8001, **kwargs) == expected


def test_ipv6_host_in_brackets_is_accepted():
    args = build_parser().parse_args(["server", "--host", "[::1]"])

    assert args.host == "::1"
    assert endpoints.public_url("http", args.host, 8001) == "http://[::1]:8001"


@pytest.mark.parametrize(
    "url, expected",
    [
        ("postgres://app:s3cret@db:5432/st", "postgres://app:****@db:5432/st"),
        ("redis://:s3cret@cache:6379/0", "redis://:****@cache:6379/0"),
        (
            "postgres://db/st?user=app&password=s3cret&sslmode=require",
            "postgres://db/st?user=app&password=****&sslmode=require",
        ),
        ("postgres://app@db/st", "postgres://app@db/st"),
        ("redis://cache:6379/0", "redis://cache:6379/0"),
    ],
)
def test_mask_url_hides_passwords(url, expected):
    assert endpoints.mask_url(url) == expected


def test_banner_never_shows_passwords():
    settings = SimpleNamespace(
        DATA_DIR=Path("/srv/st"),
        DATABASES={"default": {"ENGINE": "django.db.backends.postgresql", "NAME": "st"}},
        DATABASE_URL="postgres://app:db-s3cret@db:5432/st",
        REDIS_URL="redis://:redis-s3cret@cache:6379/0",
    )

    text = "\n".join(serve.banner_lines(settings=settings, url="https://h:8001", listen="0.0.0.0:8001"))

    assert "s3cret" not in text
    assert "postgresql postgres://app:****@db:5432/st" in text
    assert "Redis redis://:****@cache:6379/0" in text
    assert "create_api_token USERNAME --superuser" in text


def _banner_settings():
    return SimpleNamespace(
        DATA_DIR=Path("/srv/st"),
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": "/srv/st/db.sqlite3"}},
        DATABASE_URL="",
        REDIS_URL="",
    )


def test_banner_names_the_local_worker_or_says_it_is_disabled():
    common = {"settings": _banner_settings(), "url": "http://h:8001", "listen": "h:8001"}
    enabled = serve.banner_lines(**common, local_worker="local@h")
    disabled = serve.banner_lines(**common)

    assert "  Local worker local@h (jobs with target local/auto; --no-local-worker to disable)" in enabled
    assert "  Local worker disabled (--no-local-worker: jobs with target local wait)" in disabled


# --- the built-in local worker ----------------------------------------------------------------
def test_no_local_worker_flag_turns_it_off():
    assert build_parser().parse_args(["server"]).local_worker is True
    assert build_parser().parse_args(["server", "--no-local-worker"]).local_worker is False


@pytest.mark.parametrize(
    "host, expected",
    [
        ("127.0.0.1", "127.0.0.1"),
        ("127.0.0.2", "127.0.0.2"),
        ("0.0.0.0", "127.0.0.1"),
        ("::", "::1"),
        ("::1", "::1"),
        ("10.1.2.3", "10.1.2.3"),
        ("localhost", "127.0.0.1"),
        ("gpu-box.example.com", "gpu-box.example.com"),
    ],
)
def test_loopback_host_reaches_the_listening_address(host, expected):
    assert endpoints.loopback_host(host) == expected


@pytest.mark.parametrize(
    "host, expected",
    [("0.0.0.0", "http://127.0.0.1:8001"), ("::", "http://[::1]:8001"), ("10.1.2.3", "http://10.1.2.3:8001")],
)
def test_local_worker_uses_plain_http_without_tls(host, expected):
    assert endpoints.local_worker_endpoint(host, 8001) == (expected, None)


@pytest.mark.parametrize(
    "host, expected",
    [
        ("127.0.0.1", "https://127.0.0.1:8001"),
        ("0.0.0.0", "https://127.0.0.1:8001"),
        ("::", "https://[::1]:8001"),
        ("10.1.2.3", "https://10.1.2.3:8001"),
    ],
)
def test_local_worker_trusts_exactly_the_generated_certificate(tmp_path, host, expected):
    cert_path, _, _ = tls.ensure_self_signed_cert(tmp_path / "tls", host)
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())

    assert endpoints.local_worker_endpoint(host, 8001, cert=cert, certfile=cert_path) == (expected, cert_path)


def _certificate(dns_names, *, ips=(), issuer=None):
    """Return a certificate for ``dns_names``/``ips``, self-signed unless ``issuer`` names a CA."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns_names[0] if dns_names else "server")])
    issuer_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]) if issuer else subject
    now = datetime.now(timezone.utc)
    names = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(hours=1))
        .not_valid_after(now + timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .sign(key, hashes.SHA256())
    )


@pytest.mark.parametrize(
    "host, cert_kwargs, expected_url, trusts_file",
    [
        # A CA-issued certificate for the public name: dial that name, verify with the system's CAs.
        ("0.0.0.0", {"dns_names": ["orch.example.com"], "issuer": "A CA"}, "https://orch.example.com:8001", False),
        # Self-signed for the public name only (no loopback): that name, trusting exactly the file.
        ("0.0.0.0", {"dns_names": ["*.example.com", "orch.example.com"]}, "https://orch.example.com:8001", True),
        # It names localhost: loopback by that name.
        ("127.0.0.1", {"dns_names": ["localhost"], "issuer": "A CA"}, "https://localhost:8001", False),
        # It names the loopback address itself.
        ("0.0.0.0", {"dns_names": ["orch.example.com"], "ips": ["127.0.0.1"]}, "https://127.0.0.1:8001", True),
        # Listening on one address the certificate names.
        ("10.1.2.3", {"dns_names": ["orch.example.com"], "ips": ["10.1.2.3"]}, "https://10.1.2.3:8001", True),
    ],
)
def test_local_worker_dials_a_name_a_supplied_certificate_covers(host, cert_kwargs, expected_url, trusts_file):
    cert = _certificate(**cert_kwargs)
    certfile = Path("/etc/orch/cert.pem")

    url, ca_cert = endpoints.local_worker_endpoint(host, 8001, cert=cert, certfile=certfile)

    assert url == expected_url
    assert ca_cert == (certfile if trusts_file else None)


def test_worker_subcommand_runs_the_agent():
    from worker_agent import cli as agent_cli

    args = build_parser().parse_args(["worker", "--orchestrator-url", "http://h:8001", "--persistent"])

    assert args.handler is agent_cli.run
    assert (args.orchestrator_url, args.persistent) == ("http://h:8001", True)


# --- packaging and Celery ---------------------------------------------------------------------
def requirement_lines(name):
    """Return the lines of requirements file ``name`` that are neither blank nor comments."""
    lines = (line.strip() for line in (REPO_ROOT / name).read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_pyproject_pins_match_the_requirements_files():
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    runtime = requirement_lines("requirements.txt")
    dev = requirement_lines("requirements-dev.txt")

    assert sorted(pyproject["dependencies"]) == sorted(runtime)
    # The dev file is the runtime (included, not copied) plus exactly the `test` extra's pins.
    assert dev[0] == "-r requirements.txt"
    assert sorted(pyproject["optional-dependencies"]["test"]) == sorted(dev[1:])
    assert not {line.split("==")[0] for line in runtime} & {line.split("==")[0] for line in dev[1:]}
    assert pyproject["scripts"] == {"simpletuner": "simpletuner_cli.main:main"}


def test_celery_app_takes_its_configuration_from_django_settings(settings):
    from simpletuner_site.celery import app as celery_app

    assert celery_app.conf.broker_url == settings.CELERY_BROKER_URL
    assert celery_app.conf.task_ignore_result is True
