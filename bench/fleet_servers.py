"""Servers for the fleet simulator to drive: ours (`simpletuner server`, SQLite or PostgreSQL + Redis) and the peer."""

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from worker_agent import protocol

ROOT = Path(__file__).resolve().parent.parent
PEER_DIR = Path(os.environ.get("PEER_DIR") or ROOT.parent / "shared" / "peer")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url, timeout=90, proc=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except urllib.error.HTTPError:
            return  # any answer means it serves
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout} s")


class ScratchPostgres:
    """A throwaway PostgreSQL database next to the one DATABASE_URL names: created now, dropped by drop()."""

    def __init__(self, url):
        import psycopg

        self.psycopg = psycopg
        self.admin_url = url.rsplit("/", 1)[0] + "/postgres"
        self.name = f"st_fleet_{secrets.token_hex(4)}"
        self.url = url.rsplit("/", 1)[0] + "/" + self.name
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.name}"')

    def connections(self):
        with self.psycopg.connect(self.admin_url, autocommit=True) as conn:
            return conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (self.name,)).fetchone()[0]

    def drop(self):
        with self.psycopg.connect(self.admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


class Ours:
    """One or more `simpletuner server` processes sharing a fresh data dir (and database, when given).

    ``database_url`` None: SQLite in the data dir, embedded mode. With ``redis_url`` the sweeps run in a
    `manage.py run_sweeps` process beside the servers (as Celery beat would). ``timers`` are extra
    SIMPLETUNER_* settings (short ones for the failover measurement).
    """

    kind = "ours"

    def __init__(self, *, database_url=None, redis_url=None, processes=1, timers=None):
        self.dir = Path(tempfile.mkdtemp(prefix="st-fleet-"))
        self.scratch = ScratchPostgres(database_url) if database_url else None
        self.redis_url = redis_url
        self.processes = processes
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
        env.update({
            "SIMPLETUNER_DATA_DIR": str(self.dir),
            "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
            "SIMPLETUNER_LOG_LEVEL": "WARNING",
            "DJANGO_SETTINGS_MODULE": "simpletuner_site.settings",
        })
        if self.scratch:
            env["DATABASE_URL"] = self.scratch.url
        if redis_url:
            env["REDIS_URL"] = redis_url
        env.update(timers or {})
        self.env = env
        self.procs = []
        self.ports = []
        self.database = "postgresql" if database_url else "sqlite"

    @property
    def url(self):
        return f"http://127.0.0.1:{self.ports[0]}"

    def urls(self):
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def _spawn(self, args, log):
        return subprocess.Popen(args, cwd=ROOT, env=self.env, stdout=open(self.dir / log, "w"),
                                stderr=subprocess.STDOUT, start_new_session=True)

    def start(self):
        py = sys.executable
        subprocess.run([py, "manage.py", "migrate", "-v0"], cwd=ROOT, env=self.env, check=True)
        out = subprocess.run([py, "manage.py", "create_api_token", "bench", "--superuser"], cwd=ROOT,
                             env=self.env, check=True, capture_output=True, text=True)
        self.token = out.stdout.strip().splitlines()[-1]
        for i in range(self.processes):
            port = free_port()
            self.ports.append(port)
            self.procs.append(self._spawn([py, "-m", "simpletuner_cli", "server", "--host", "127.0.0.1", "--port",
                                           str(port), "--no-migrate", "--no-local-worker"], f"server{i}.log"))
        if self.redis_url:
            self.procs.append(self._spawn([py, "manage.py", "run_sweeps"], "sweeps.log"))
        for port, proc in zip(self.ports, self.procs):
            wait_http(f"http://127.0.0.1:{port}{protocol.QUEUE_PATH}", proc=proc)
        return self

    def admin_headers(self):
        return {"Authorization": f"Bearer {self.token}"}

    def server_pids(self):
        return [p.pid for p in self.procs[: self.processes]]

    def db_connections(self):
        if self.scratch:
            return self.scratch.connections()
        import psutil

        db = str(self.dir / "orchestrator.sqlite3")
        return sum(1 for f in psutil.Process(self.procs[0].pid).open_files() if f.path == db)

    def tail(self, n=800):
        return "\n".join((self.dir / f"server{i}.log").read_text(errors="replace")[-n:] for i in range(self.processes))

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=5)
        if self.scratch:
            self.scratch.drop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PeerServer:
    """SimpleTuner's own orchestrator, started by ``shared/peer/peer.py`` (built by its build.sh)."""

    kind = "peer"
    database = "sqlite"
    redis_url = None
    processes = 1

    def __init__(self, **_ignored):
        sys.path.insert(0, str(PEER_DIR))
        from peer import Peer

        self.peer = Peer()

    @property
    def url(self):
        return self.peer.url

    def urls(self):
        return [self.peer.url]

    def start(self):
        self.peer.start()
        self.peer.prepare("bench")
        return self

    def admin_headers(self):
        return {}

    def server_pids(self):
        import psutil

        # peer.py starts the server through the venv's python; the uvicorn process is that one
        return [psutil.Process(self.peer.proc.pid).pid]

    def db_connections(self):
        return None

    def tail(self, n=800):
        return self.peer.tail(n)

    def stop(self):
        if self.peer.proc is not None and self.peer.proc.poll() is not None:
            print(f"the peer had exited with status {self.peer.proc.returncode}", file=sys.stderr)
        with contextlib.suppress(OSError):
            shutil.copy(self.peer.log, Path(tempfile.gettempdir()) / "fleet-peer-last.log")
        self.peer.cleanup()


def server_for(name, *, database_url=None, redis_url=None, processes=1, timers=None):
    if name == "peer":
        return PeerServer()
    return Ours(database_url=database_url, redis_url=redis_url, processes=processes, timers=timers)
