"""Issue 14.7 with real processes: a port in use is one clear line and a non-zero exit; SIGTERM with open
worker streams exits cleanly within seconds, with no traceback; a browser at / finds a landing page and
its favicon request is answered. Issue 32: a database that cannot be used stops the server within 10 s with the
driver's reason, a Redis that does not answer is a warning (a failure in production mode), an environment file
named by SIMPLETUNER_ENV_FILE is read or its absence is an error, and manage.py says when it used the embedded
SQLite database."""

import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest

from .harness import REPO_ROOT, Fleet, Orchestrator, _with_database, free_port, poll

pytestmark = pytest.mark.e2e

SHUTDOWN_S = 8
FAIL_FAST_S = 10  # issue 32: a database or Redis that cannot be used stops the server within this


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


def run_server(env, *args, timeout=60):
    """Run ``simpletuner server`` (no local worker) in ``env`` until it exits; return (result, seconds it took)."""
    argv = [sys.executable, "-m", "simpletuner_cli", "server", "--port", str(free_port()), "--no-local-worker", *args]
    started = time.monotonic()
    result = subprocess.run(argv, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return result, time.monotonic() - started


def test_a_database_that_cannot_be_reached_stops_the_server_within_seconds_with_the_reason(tmp_path):
    url = f"postgres://postgres:s3cret@127.0.0.1:{free_port()}/simpletuner"  # nothing listens there
    env = Orchestrator(backend="sqlite", data_dir=tmp_path, database_url=url).env()

    for args in ((), ("--no-migrate",)):  # as the systemd units start it too
        result, took = run_server(env, *args)

        assert result.returncode == 1, result.stderr
        assert took < FAIL_FAST_S, result.stderr
        assert result.stdout == ""  # not even the banner
        [line] = result.stderr.splitlines()
        assert line.startswith("simpletuner server: error: cannot use the database postgres://postgres:****@127.0.0.1:")
        assert "Connection refused" in line and line.endswith("(check DATABASE_URL)")
        assert "s3cret" not in line


@pytest.mark.postgres
def test_a_database_that_does_not_exist_stops_the_server_within_seconds_with_the_reason(tmp_path, postgres_url):
    name = f"st_e2e_missing_{secrets.token_hex(4)}"
    env = Orchestrator(backend="postgres", data_dir=tmp_path, database_url=_with_database(postgres_url, name)).env()

    result, took = run_server(env, "--no-migrate")

    assert result.returncode == 1, result.stderr
    assert took < FAIL_FAST_S, result.stderr
    assert f'FATAL: database "{name}" does not exist (check DATABASE_URL)' in result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr

    # manage.py (the migrate unit) connects without psycopg's pool: the driver's reason at once, not 30 s later
    started = time.monotonic()
    migrate = subprocess.run(
        [sys.executable, "manage.py", "migrate", "--noinput"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert migrate.returncode == 1
    assert time.monotonic() - started < FAIL_FAST_S
    assert migrate.stderr.splitlines()[-1].endswith(f'FATAL:  database "{name}" does not exist')


def test_a_redis_that_does_not_answer_is_a_warning_and_the_server_serves(tmp_path):
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    server = Orchestrator(backend="sqlite", data_dir=tmp_path, redis_url=redis_url, via_cli=True).start()
    try:
        log = server.read_log()
    finally:
        server.stop()
    assert f"simpletuner server: warning: Redis {redis_url} does not answer: " in log
    assert "Connection refused" in log and "serving anyway" in log


def test_in_production_mode_a_redis_that_does_not_answer_stops_the_server(tmp_path):
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    production = {
        "SIMPLETUNER_PRODUCTION": "true",
        "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
        "DJANGO_ALLOWED_HOSTS": "orchestrator.example.com",
    }
    env = Orchestrator(backend="sqlite", data_dir=tmp_path, redis_url=redis_url, extra_env=production).env()

    result, took = run_server(env)

    assert result.returncode == 1, result.stderr
    assert took < FAIL_FAST_S, result.stderr
    assert result.stdout == ""
    [line] = result.stderr.splitlines()
    assert line.startswith(f"simpletuner server: error: Redis {redis_url} does not answer: ")
    assert "Connection refused" in line and "production mode needs it" in line


class EnvFileOrchestrator(Orchestrator):
    """An orchestrator whose every process (manage.py, the server, Celery) gets its data directory, database and
    Redis only from the environment file named by SIMPLETUNER_ENV_FILE."""

    def __init__(self, *, env_file, **kwargs):
        super().__init__(**kwargs)
        self.env_file = env_file

    def write_env_file(self):
        lines = [f"SIMPLETUNER_DATA_DIR={self.data_dir}"]
        lines += [f"DATABASE_URL={self.database_url}"] if self.database_url else []
        lines += [f"REDIS_URL={self.redis_url}"] if self.redis_url else []
        self.env_file.write_text("# written by the test\n" + "\n".join(lines) + "\n")
        return self

    def env(self):
        env = super().env()
        for name in ("SIMPLETUNER_DATA_DIR", "DATABASE_URL", "REDIS_URL"):
            env.pop(name, None)
        env["SIMPLETUNER_ENV_FILE"] = str(self.env_file)
        return env


def test_the_env_file_is_read_by_manage_py_and_the_server(tmp_path):
    """On SQLite: the token made with manage.py lands in the data directory the file names, which the server reads."""
    data_dir = tmp_path / "from-the-file"
    server = EnvFileOrchestrator(backend="sqlite", data_dir=data_dir, env_file=tmp_path / "orchestrator.env", via_cli=True)
    server.write_env_file().start()  # manage.py migrate and create_api_token, then the server: each by the file
    try:
        assert server.admin("GET", "/api/queue/").status_code == 200  # the token is in the server's database
        log = server.read_log()
    finally:
        server.stop()
    assert f"  Env file     {tmp_path / 'orchestrator.env'}" in log
    assert f"  Database     SQLite {data_dir / 'orchestrator.sqlite3'} (embedded: DATABASE_URL is not set)" in log


def test_a_missing_env_file_is_an_error_for_the_server_and_manage_py(tmp_path):
    missing = tmp_path / "orchestrator.env"
    env = {**Orchestrator(backend="sqlite", data_dir=tmp_path / "data").env(), "SIMPLETUNER_ENV_FILE": str(missing)}
    reason = f"SIMPLETUNER_ENV_FILE={missing}: cannot read the environment file: No such file or directory"

    result, _took = run_server(env)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines() == [f"simpletuner server: error: configuration: {reason}"]

    manage = subprocess.run(
        [sys.executable, "manage.py", "create_api_token", "admin", "--superuser"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (manage.returncode, manage.stdout) == (1, "")
    assert manage.stderr.splitlines() == [f"manage.py: error: configuration: {reason}"]
    assert not (tmp_path / "data" / "orchestrator.sqlite3").exists()  # nothing fell back to the embedded database


def test_manage_py_says_when_it_used_the_embedded_sqlite_database(tmp_path):
    server = Orchestrator(backend="sqlite", data_dir=tmp_path)
    env = server.env()

    def manage(*args):
        return subprocess.run(
            [sys.executable, "manage.py", *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
        )

    notice = (
        f"manage.py: used the embedded SQLite database {tmp_path / 'orchestrator.sqlite3'} (DATABASE_URL is not set; "
        "SIMPLETUNER_ENV_FILE=/etc/simpletuner/orchestrator.env reads a production one)"
    )
    # The wrong turn: the production guide's command without its environment file, on a fresh checkout.
    unmigrated = manage("create_api_token", "admin", "--superuser")
    assert (unmigrated.returncode, unmigrated.stdout) == (1, "")
    assert unmigrated.stderr.splitlines()[-2:] == ["django.db.utils.OperationalError: no such table: auth_user", notice]

    assert manage("migrate", "--noinput", "-v", "0").returncode == 0
    made = manage("create_api_token", "admin", "--superuser")

    assert made.returncode == 0, made.stderr
    assert made.stdout.strip().startswith("sta_")
    assert made.stderr.splitlines()[-1] == notice
    assert "embedded SQLite" not in manage("help").stderr  # no database, nothing to say
