"""End-to-end harness: a real orchestrator (daphne subprocess), an HTTP API client and an SSE client."""

import codecs
import json
import os
import queue
import re
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psutil
import requests

from worker_agent import protocol
from worker_agent.session import socket_of
from worker_agent.runner import parent_death_signal

REPO_ROOT = Path(__file__).resolve().parents[2]
ASGI_APPLICATION = "simpletuner_site.asgi:application"

START_DEADLINE_S = 60
STOP_GRACE_S = 10
HTTP_TIMEOUT = (5, 30)
STREAM_TIMEOUT = (5, 60)
EVENT_DEADLINE_S = 10

# Environment the test process may carry that must not leak into a server it does not configure.
_SCRUBBED_ENV = ("DATABASE_URL", "REDIS_URL", "DJANGO_SETTINGS_MODULE", "DJANGO_SECRET_KEY", "DJANGO_DEBUG")
# The SIMPLETUNER_* variables a test run sets for every server it starts (.ci/run runs the protocol and
# end-to-end tests once with SIMPLETUNER_FAST_PATHS=off); every other SIMPLETUNER_* is the test's to set.
PASSED_THROUGH_ENV = ("SIMPLETUNER_FAST_PATHS",)


class HarnessError(RuntimeError):
    """The orchestrator could not be prepared or started."""


def free_port():
    """Return a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_process(process, grace=STOP_GRACE_S):
    """Terminate ``process`` (None or already ended is fine): SIGTERM, then SIGKILL after ``grace`` seconds."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=grace)


def poll(predicate, *, timeout, interval=0.05, message="condition"):
    """Call ``predicate`` until it returns a truthy value (returned) or ``timeout`` seconds pass (AssertionError)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}; last value: {last!r}")
        time.sleep(interval)


def expect(response, status):
    """Assert ``response`` has HTTP ``status``; return its JSON body (None for an empty body)."""
    assert response.status_code == status, (
        f"{response.request.method} {response.url}: expected {status}, "
        f"got {response.status_code}: {response.text[:2000]}"
    )
    if not response.content:
        return None
    return response.json()


# --- PostgreSQL: one brand-new database per run ---------------------------------------------------


def _with_database(url, name):
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def _admin_connection(server_url):
    """Connect (autocommit) for CREATE/DROP DATABASE: to ``postgres``, else the URL's own database (as Django)."""
    import psycopg

    try:
        return psycopg.connect(_with_database(server_url, "postgres"), autocommit=True, connect_timeout=10)
    except psycopg.OperationalError:
        return psycopg.connect(server_url, autocommit=True, connect_timeout=10)


def create_database(server_url):
    """Create a fresh database on the PostgreSQL server of ``server_url``; return its URL."""
    name = f"st_e2e_{secrets.token_hex(6)}"
    with _admin_connection(server_url) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return _with_database(server_url, name)


def drop_database(server_url, database_url):
    """Drop the database of ``database_url`` (made by create_database), ending its sessions."""
    name = urlsplit(database_url).path.lstrip("/")
    assert name.startswith("st_e2e_"), name
    with _admin_connection(server_url) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def own_orchestrator(request, data_dir, **options):
    """Yield a started Orchestrator of a test's own on ``request.param``'s backend: ``"sqlite"`` (the embedded
    default) or ``"postgres"`` (a brand-new database beside DATABASE_URL's, with REDIS_URL: the fixtures
    ``postgres_url`` and ``redis_url``); ``options`` go to Orchestrator. Stop it and drop its database after."""
    server_url = database_url = redis_url = None
    if request.param == "postgres":
        server_url = request.getfixturevalue("postgres_url")
        redis_url = request.getfixturevalue("redis_url")
        database_url = create_database(server_url)
    server = Orchestrator(backend=request.param, data_dir=data_dir, database_url=database_url, redis_url=redis_url, **options)
    try:
        yield server.start()
    finally:
        server.stop()
        if database_url:
            drop_database(server_url, database_url)


# --- the orchestrator process ---------------------------------------------------------------------


class Orchestrator:
    """A migrated data dir, an operator token and a daphne process serving the orchestrator.

    By default daphne is started directly (the serving package's server: ``python -m serving``): no sweeps run.
    With ``via_cli`` the server is
    ``simpletuner server --no-local-worker --no-migrate`` instead, whose embedded scheduler runs the
    sweeps when there is no ``redis_url``; with ``celery`` a Celery worker with embedded beat
    (``celery -A simpletuner_site.celery worker -B``) runs them beside it, in the same environment.
    ``extra_env`` (e.g. the ``SIMPLETUNER_*`` timers) is added to the environment of every process.
    """

    def __init__(
        self, *, backend, data_dir, database_url=None, redis_url=None, via_cli=False, celery=False, extra_env=None
    ):
        self.backend = backend
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.data_dir / "daphne.log"
        self.celery_log_path = self.data_dir / "celery.log"
        self.database_url = database_url
        self.redis_url = redis_url
        self.via_cli = via_cli
        self.celery = celery
        self.extra_env = dict(extra_env or {})
        self.process = None
        self.celery_process = None
        self.port = None
        self.base_url = None
        self.admin_token = None
        self.http = requests.Session()

    # environment and management commands

    def env(self):
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in _SCRUBBED_ENV and (k in PASSED_THROUGH_ENV or not k.startswith("SIMPLETUNER_"))
        }
        env.update(
            SIMPLETUNER_DATA_DIR=str(self.data_dir),
            DJANGO_SETTINGS_MODULE="simpletuner_site.settings",
            PYTHONUNBUFFERED="1",
        )
        if self.database_url:
            env["DATABASE_URL"] = self.database_url
        if self.redis_url:
            env["REDIS_URL"] = self.redis_url
        env.update(self.extra_env)
        return env

    def manage(self, *args, timeout=180):
        """Run ``manage.py *args`` against this orchestrator's data; return stdout (HarnessError on failure)."""
        result = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO_ROOT,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if result.returncode != 0:
            raise HarnessError(
                f"manage.py {' '.join(args)} exited {result.returncode}\n"
                f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
            )
        return result.stdout

    # lifecycle

    def start(self):
        """Migrate, create the admin token, start the server (and Celery); on any failure stop what started."""
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self):
        self.manage("migrate", "--noinput", "-v", "0")
        lines = self.manage("create_api_token", "admin", "--superuser", "--description", "e2e").strip().splitlines()
        if not lines or not lines[-1].startswith("sta_"):
            raise HarnessError(f"create_api_token printed no token: {lines!r}")
        self.admin_token = lines[-1].strip()
        last_error = None
        for _ in range(3):  # a port taken between free_port() and daphne's bind: try another
            try:
                self._spawn(free_port())
                break
            except HarnessError as exc:
                last_error = exc
                self.stop()
        else:
            raise last_error
        if self.celery:
            self._spawn_celery()
        return self

    def _server_argv(self, port):
        if self.via_cli:
            return [
                sys.executable, "-m", "simpletuner_cli", "server",
                "--host", "127.0.0.1", "--port", str(port), "--no-local-worker", "--no-migrate",
            ]  # fmt: skip
        return [sys.executable, "-m", "serving", "-b", "127.0.0.1", "-p", str(port), ASGI_APPLICATION]

    def _spawn(self, port):
        self.port = port
        self.base_url = f"http://127.0.0.1:{port}"
        with open(self.log_path, "ab") as log:
            log.write(f"\n===== starting the server on port {port} =====\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self._server_argv(port),
                cwd=REPO_ROOT,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=parent_death_signal(),
            )
        deadline = time.monotonic() + START_DEADLINE_S
        last = "no attempt"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise HarnessError(f"daphne exited with {self.process.returncode} while starting\n{self.read_log()}")
            try:
                response = self.admin("GET", "/api/queue/", timeout=(1, 5))
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {response.text[:300]}"
            except requests.RequestException as exc:
                last = repr(exc)
            time.sleep(0.1)
        raise HarnessError(f"daphne did not answer within {START_DEADLINE_S}s (last: {last})\n{self.read_log()}")

    def _spawn_celery(self):
        """Start a Celery worker with embedded beat; wait until it says it is ready (HarnessError if not)."""
        argv = [
            sys.executable, "-m", "celery", "-A", "simpletuner_site.celery", "worker", "-B",
            "--loglevel", "INFO", "--concurrency", "1", "--without-gossip", "--without-mingle",
            "--hostname", f"e2e-{secrets.token_hex(4)}@%h", "--schedule", str(self.data_dir / "celerybeat-schedule"),
        ]  # fmt: skip
        offset = self.celery_log_size()
        with open(self.celery_log_path, "ab") as log:
            self.celery_process = subprocess.Popen(
                argv,
                cwd=REPO_ROOT,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=parent_death_signal(),
            )
        deadline = time.monotonic() + START_DEADLINE_S
        while time.monotonic() < deadline:
            if self.celery_process.poll() is not None:
                raise HarnessError(f"celery exited with {self.celery_process.returncode}\n{self.read_celery_log(offset)}")
            text = self.read_celery_log(offset)
            if " ready." in text and "beat: Starting" in text:
                return
            time.sleep(0.1)
        raise HarnessError(f"celery was not ready within {START_DEADLINE_S}s\n{self.read_celery_log(offset)}")

    def _stop_celery(self):
        process, self.celery_process = self.celery_process, None
        if process is None:
            return
        try:
            children = psutil.Process(process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            children = []
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=STOP_GRACE_S)
        for child in children:  # pool and beat processes it started, should any outlive it
            try:
                child.kill()
            except psutil.NoSuchProcess:
                pass

    def stop(self):
        """Terminate the server (SIGTERM, then SIGKILL after a grace period) and the Celery worker, if any."""
        self.http.close()
        process, self.process = self.process, None
        try:
            stop_process(process)
        finally:
            self._stop_celery()

    def kill(self):
        """SIGKILL the server process (not the Celery worker) and reap it: a crash, not a shutdown."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.wait(timeout=STOP_GRACE_S)
        self.http.close()

    def restart(self):
        """Start the server again on the same port and data (after ``kill`` or ``stop``); wait until it answers."""
        assert self.process is None, "the server is still running"
        self._spawn(self.port)
        return self

    def is_alive(self):
        return self.process is not None and self.process.poll() is None

    def log_size(self):
        try:
            return self.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def read_log(self, offset=0, limit=40_000, *, path=None):
        """Return the server log from byte ``offset`` (at most the last ``limit`` characters)."""
        try:
            with open(path or self.log_path, "rb") as fh:
                fh.seek(offset)
                text = fh.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return "(no log)"
        return text if len(text) <= limit else "...\n" + text[-limit:]

    def celery_log_size(self):
        try:
            return self.celery_log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def read_celery_log(self, offset=0, limit=40_000):
        """Return the Celery worker's log from byte ``offset``."""
        return self.read_log(offset, limit, path=self.celery_log_path)

    # HTTP

    def url(self, path):
        return self.base_url + path

    def request(self, method, path, *, headers=None, timeout=HTTP_TIMEOUT, **kwargs):
        return self.http.request(method, self.url(path), headers=headers or {}, timeout=timeout, **kwargs)

    def admin(self, method, path, **kwargs):
        """Call the API as the operator (``Authorization: Bearer sta_...``)."""
        headers = {"Authorization": f"Bearer {self.admin_token}", **kwargs.pop("headers", {})}
        return self.request(method, path, headers=headers, **kwargs)

    def as_worker(self, token, method, path, **kwargs):
        """Call the API as a worker (``X-Worker-Token``)."""
        headers = {protocol.WORKER_TOKEN_HEADER: token, **kwargs.pop("headers", {})}
        return self.request(method, path, headers=headers, **kwargs)

    def stream(self, token, *, last_event_id=None, params=None):
        """Open ``GET /api/workers/stream``; return the SSEClient (reading in the background when 200)."""
        headers = {}
        if token is not None:
            headers[protocol.WORKER_TOKEN_HEADER] = token
        if last_event_id is not None:
            headers["Last-Event-ID"] = last_event_id
        return SSEClient.connect(self.url(protocol.STREAM_PATH), headers=headers, params=params)

    # queue and audit reads

    def job(self, job_id):
        return expect(self.admin("GET", f"/api/queue/{job_id}"), 200)

    def worker(self, worker_id):
        return expect(self.admin("GET", f"/api/admin/workers/{worker_id}"), 200)

    def audit(self, **params):
        body = expect(self.admin("GET", "/api/audit/", params={"limit": 1000, **params}), 200)
        return body["results"] if isinstance(body, dict) else body


# --- SSE -------------------------------------------------------------------------------------------


@dataclass
class SSEEvent:
    """One dispatched Server-Sent Event."""

    type: str
    data: str
    id: str | None  # the stream's last event id when this event was dispatched (SSE "lastEventId")
    own_id: bool  # whether this event carried an id: line itself

    def json(self):
        return json.loads(self.data)


_END = object()
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


class SSEClient:
    """A Server-Sent Events reader on a background thread, parsing per the WHATWG SSE rules.

    Events go through a queue to the test thread; ``wait_for`` takes them with a deadline. The client
    records every raw line, comments, and when (and how) the stream ended.
    """

    def __init__(self, response):
        self.response = response
        self.status_code = response.status_code
        self.events = []  # every event taken from the queue, in order
        self.lines = []  # every raw line received (read by the reader thread)
        self.comments = 0
        self.last_event_id = None  # what a reconnecting client sends as Last-Event-ID
        self.ended = threading.Event()
        self.end_reason = None
        self._queue = queue.Queue()
        self._taken = set()
        self._closing = False
        self._end_taken = False
        self._reader = None
        # parser state (reader thread only)
        self._data = []
        self._event_type = ""
        self._id_buffer = None
        self._id_seen = False

    @classmethod
    def connect(cls, url, *, headers, params=None):
        response = requests.get(url, headers=headers, params=params, stream=True, timeout=STREAM_TIMEOUT)
        client = cls(response)
        if response.status_code == 200:
            client.start()
        else:
            client.body = response.content
            response.close()
            client.ended.set()
            client.end_reason = f"HTTP {response.status_code}"
            client._queue.put(_END)
        return client

    # reader thread

    def start(self):
        """Start reading the (200) response on a background thread."""
        self._reader = threading.Thread(target=self._read, name="sse-reader", daemon=True)
        self._reader.start()
        return self

    def _read(self):
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        pending = ""
        first = True
        try:
            for chunk in self.response.iter_content(chunk_size=None):
                pending += decoder.decode(chunk)
                if first and pending:
                    pending = pending.removeprefix("\ufeff")
                    first = False
                while True:
                    match = _LINE_BREAK.search(pending)
                    if match is None or (match.group() == "\r" and match.end() == len(pending)):
                        break  # no complete line yet (a lone CR at the end may be half of CRLF)
                    line, pending = pending[: match.start()], pending[match.end() :]
                    self._line(line)
            self.end_reason = "closed by client" if self._closing else "server closed the stream"
        except Exception as exc:  # noqa: BLE001 - every way a stream ends is recorded, not raised
            self.end_reason = "closed by client" if self._closing else f"error: {exc!r}"
        finally:
            self.ended.set()
            self._queue.put(_END)

    def _line(self, line):
        self.lines.append(line)
        if line == "":
            self._dispatch()
            return
        if line.startswith(":"):
            self.comments += 1
            return
        field, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if field == "event":
            self._event_type = value
        elif field == "data":
            self._data.append(value)
        elif field == "id":
            if "\0" not in value:
                self._id_buffer = value
                self._id_seen = True
        # "retry" and unknown fields are ignored

    def _dispatch(self):
        own_id, self._id_seen = self._id_seen, False
        if not self._data:
            self._event_type = ""
            return
        event = SSEEvent(
            type=self._event_type or "message", data="\n".join(self._data), id=self._id_buffer, own_id=own_id
        )
        self._data = []
        self._event_type = ""
        self._queue.put(event)

    # test thread

    def _take(self, timeout):
        """Move one item from the reader's queue into ``events``; return False on timeout or end."""
        try:
            item = self._queue.get(timeout=max(timeout, 0))
        except queue.Empty:
            return False
        if item is _END:
            self._queue.put(_END)  # keep the end visible to later calls
            self._end_taken = True
            return False
        self.events.append(item)
        if item.id is not None:
            self.last_event_id = item.id
        return True

    def _drain(self):
        while self._take(0):
            pass

    def received(self, type=None):
        """Return every event received so far (of ``type`` if given)."""
        self._drain()
        return [e for e in self.events if type is None or e.type == type]

    def wait_for(self, type=None, *, timeout=EVENT_DEADLINE_S, where=None):
        """Return the first not yet returned event of ``type`` (and matching ``where``) within ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            self._drain()
            for index, event in enumerate(self.events):
                if index in self._taken or (type is not None and event.type != type):
                    continue
                if where is not None and not where(event):
                    continue
                self._taken.add(index)
                return event
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._end_taken:
                state = f"stream ended ({self.end_reason})" if self.ended.is_set() else "stream still open"
                seen = [(e.type, e.data[:200]) for e in self.events]
                raise AssertionError(f"no {type or 'event'} within {timeout}s; {state}; events seen: {seen}")
            self._take(min(remaining, 0.2))

    def assert_no_event(self, type=None, *, within, where=None):
        """Assert that no event of ``type`` (matching ``where``) arrives, watching for ``within`` seconds."""
        deadline = time.monotonic() + within
        while True:
            self._drain()
            unexpected = [e for e in self.events if (type is None or e.type == type) and (where is None or where(e))]
            assert not unexpected, f"unexpected event(s): {[(e.type, e.data[:200]) for e in unexpected]}"
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            if not self._take(min(remaining, 0.2)) and self._end_taken:
                return  # the stream ended: nothing more can arrive

    def wait_closed(self, timeout=EVENT_DEADLINE_S):
        """Assert that the stream ends within ``timeout`` seconds; return how it ended."""
        if not self.ended.wait(timeout):
            seen = [e.type for e in self.received()]
            raise AssertionError(f"stream still open after {timeout}s; events seen: {seen}")
        self._drain()
        return self.end_reason

    def close(self):
        """Close the stream from the client side and wait for the reader to stop."""
        if self.ended.is_set() and self._reader is None:
            return
        self._closing = True
        sock = socket_of(self.response)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.response.close()
        if self._reader is not None:
            self._reader.join(timeout=EVENT_DEADLINE_S)
        self._drain()


# --- workers and a per-test fleet ----------------------------------------------------------------


class WorkerHandle:
    """A worker created through the admin API, and its agent's side of the protocol."""

    def __init__(self, orchestrator, created):
        self.orch = orchestrator
        self.id = created["worker_id"]
        self.name = created["name"]
        self.token = created["token"]
        self.created = created

    def call(self, method, path, **kwargs):
        return self.orch.as_worker(self.token, method, path, **kwargs)

    def register(self, body=None, *, status=200):
        body = {"name": self.name} if body is None else body
        return expect(self.call("POST", protocol.REGISTER_PATH, json=body), status)

    def heartbeat(self, body=None, *, status=200):
        body = {"worker_id": self.id, "status": "idle", "current_job_id": None} if body is None else body
        return expect(self.call("POST", protocol.HEARTBEAT_PATH, json=body), status)

    def report(self, job_id, status_value, *, status=200, **fields):
        body = {"status": status_value, **fields}
        return expect(self.call("POST", protocol.job_status_path(job_id), json=body), status)

    def disconnect(self, *, status=200):
        return expect(self.call("POST", protocol.DISCONNECT_PATH, json={"worker_id": self.id}), status)

    def state(self):
        return self.orch.worker(self.id)


class Fleet:
    """Workers, jobs and streams made by one test; torn down (streams closed, workers offline) after it."""

    def __init__(self, orchestrator, tag):
        self.orch = orchestrator
        self.tag = f"{tag[:24]}-{secrets.token_hex(4)}"
        self.workers = []
        self.streams = []
        self._count = 0

    def create_worker(self, *, labels=None, worker_type="persistent"):
        self._count += 1
        body = {"name": f"e2e-{self.tag}-{self._count}", "worker_type": worker_type, "labels": labels or {}}
        worker = WorkerHandle(self.orch, expect(self.orch.admin("POST", "/api/admin/workers", json=body), 201))
        self.workers.append(worker)
        return worker

    def open_stream(self, worker, *, token=None, last_event_id=None, params=None, wait_open=True):
        """Open ``worker``'s stream (200 expected); by default wait until the server says ``stream-open``."""
        client = self.orch.stream(worker.token if token is None else token, last_event_id=last_event_id, params=params)
        self.streams.append(client)
        assert client.status_code == 200, f"stream refused: HTTP {client.status_code}: {client.body[:500]!r}"
        if wait_open:
            client.wait_for(protocol.STREAM_OPEN)
        return client

    def submit(self, body, *, status=201):
        return expect(self.orch.admin("POST", "/api/queue/submit", json=body), status)

    def cleanup(self):
        for client in self.streams:
            client.close()
        for worker in self.workers:
            try:
                worker.call("POST", protocol.DISCONNECT_PATH, json={})
            except requests.RequestException:
                pass
