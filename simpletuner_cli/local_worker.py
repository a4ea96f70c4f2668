"""The built-in local worker: `simpletuner server` runs the worker agent as a supervised subprocess.

It is the same program as on a remote GPU node (``python -m worker_agent``), reaching this server over
loopback. Jobs with target ``local`` run only on it; ``auto`` jobs fall back to it (see docs/operator-guide.md).
"""

import contextlib
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from worker_agent.runner import describe_exit, parent_death_signal

TOKEN_FILE = "local-worker.token"
LOCK_FILE = "local-worker.lock"
JOBS_DIR = "jobs"
TOKEN_ENV = "SIMPLETUNER_WORKER_TOKEN"
OUTPUT_PREFIX = "[local worker] "
MESSAGE_PREFIX = "local worker: "
MASK = "****"
SERVER_SECRETS_ENV = frozenset({"DATABASE_URL", "REDIS_URL", "DJANGO_SECRET_KEY"})
# The agent gives a job SIMPLETUNER_CANCEL_GRACE (30 s by default) to stop, then reports it: wait for that.
STOP_TIMEOUT_S = 40
SECOND_SIGNAL_AFTER_S = 0.5
KILL_AFTER_S = 5
# The agent starts before the server listens (daphne opens its port after the local worker starts), so its
# first tries to register are refused. Its "cannot reach" lines are held back this long after it starts and
# dropped once it registers; a refusal still coming after that is real, and printed with those held.
LISTENER_GRACE_S = 15.0
UNREACHABLE_MARK = "cannot reach the orchestrator"  # worker_agent.client's words for a connection error
REGISTERED_MARK = "Registered as "  # worker_agent.session's line once registered


class RestartBackoff:
    """Delays between restarts: ``initial`` doubling up to ``cap``, back to ``initial`` after a healthy run.

    No jitter: there is one agent per server process, so there is no herd of clients to spread out.
    """

    def __init__(self, initial=1.0, cap=60.0, healthy_after=60.0):
        self.initial = initial
        self.cap = cap
        self.healthy_after = healthy_after
        self._next = initial

    def delay(self, ran_for):
        """Return the delay before restarting a process that ran ``ran_for`` seconds (0 if it never ran)."""
        if ran_for >= self.healthy_after:
            self._next = self.initial
        delay = self._next
        self._next = min(self._next * 2, self.cap)
        return delay


def provision_local_worker(name, plaintext):
    """Return the local worker's token: ``plaintext`` if it is still valid, else a newly issued one.

    Creates the worker on first use. Uses a database connection of its own and closes it afterwards,
    so any thread may call it. Raise Conflict if ``name`` belongs to a worker that is not local.
    """
    from django.db import close_old_connections, connection

    from audit.services import Actor
    from workers.services import worker_provision_local

    close_old_connections()
    try:
        _, token = worker_provision_local(name=name, actor=Actor.system("simpletuner server"), plaintext=plaintext)
    finally:
        connection.close()
    return token


def _print_line(line):
    print(line, flush=True)


def _one_line(exc):
    return " ".join(str(exc).split()) or type(exc).__name__


class LocalWorker:
    """Run ``python -m worker_agent`` for this server, echo its output and restart it when it exits.

    ``start()`` provisions the worker and spawns the agent; ``stop()`` stops it. The token travels
    only in the agent's environment (``SIMPLETUNER_WORKER_TOKEN``) and in ``<data_dir>/local-worker.token``
    (mode 0600), never on its command line. An exclusive lock on ``<data_dir>/local-worker.lock`` lets
    only one server process per data directory run the agent.
    """

    def __init__(
        self,
        *,
        url,
        data_dir,
        name,
        ca_cert=None,
        verbose=False,
        popen=subprocess.Popen,
        clock=time.monotonic,
        provision=provision_local_worker,
        output=_print_line,
        backoff=None,
        second_signal_after=SECOND_SIGNAL_AFTER_S,
        listener_grace=LISTENER_GRACE_S,
    ):
        self.url = url
        self.data_dir = Path(data_dir)
        self.name = name
        self.ca_cert = ca_cert
        self.verbose = verbose
        self._popen = popen
        self._clock = clock
        self._provision = provision
        self._output = output
        self._backoff = backoff or RestartBackoff()
        self._second_signal_after = second_signal_after
        self._listener_grace = listener_grace
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._process = None
        self._spawned_at = None
        self._token = None
        self._lock_fd = None
        self._thread = None

    @property
    def token_path(self):
        return self.data_dir / TOKEN_FILE

    @property
    def lock_path(self):
        return self.data_dir / LOCK_FILE

    @property
    def process(self):
        """The agent process now running (or last run), or None."""
        return self._process

    def agent_argv(self):
        """Return the agent's command line; it never holds the token."""
        argv = [
            sys.executable,
            "-m",
            "worker_agent",
            "--orchestrator-url",
            self.url,
            "--name",
            self.name,
            "--persistent",
            "--work-dir",
            str(self.data_dir / JOBS_DIR),
        ]
        if self.ca_cert is not None:
            argv += ["--ca-cert", str(self.ca_cert)]
        if self.verbose:
            argv.append("-v")
        return argv

    def agent_env(self, token):
        """Return the agent's environment: the server's (``SIMPLETUNER_WORKER_COMMAND`` included) plus the token.

        The server's own credentials (database, Redis, secret key) are left out: jobs run in it.
        """
        env = {key: value for key, value in os.environ.items() if key not in SERVER_SECRETS_ENV}
        return {**env, TOKEN_ENV: token, "PYTHONUNBUFFERED": "1"}

    # --- life cycle -----------------------------------------------------------------------------
    def start(self):
        """Provision the worker and start the agent; return False if another server process runs it.

        A failure to provision (no tables yet under --no-migrate, a name taken by a remote worker) is
        printed and retried with backoff, like an agent that exits: it never stops the server.
        """
        if self._stopping.is_set():
            return False
        if not self._acquire_lock():
            self._say("another server process on this data dir runs it")
            return False
        try:
            process, failure = self._launch(), None
        except Exception as exc:  # reported and retried by the supervisor thread
            process, failure = None, f"could not start the agent ({_one_line(exc)})"
        self._thread = threading.Thread(
            target=self._supervise, args=(process, failure), name="local-worker", daemon=True
        )
        self._thread.start()
        return True

    def stop(self, timeout=STOP_TIMEOUT_S):
        """Stop the agent and its job now, and release the data-dir lock. Idempotent.

        The agent's signal rule: a first SIGTERM finishes the job, a second stops it now (reported, so
        it is requeued), a third kills it and exits at once. So: SIGTERM, a second SIGTERM shortly
        after, up to ``timeout`` for the agent to stop the job and report it, a third SIGTERM, and
        SIGKILL to its process group if it is still alive ``KILL_AFTER_S`` later.
        """
        with self._lock:
            if self._stopping.is_set():
                return
            self._stopping.set()
            process = self._process
        if process is not None and process.poll() is None:
            for wait in (self._second_signal_after, timeout, KILL_AFTER_S):
                process.send_signal(signal.SIGTERM)
                if self._waited(process, wait):
                    break
            else:
                self._kill(process)
                self._waited(process, KILL_AFTER_S)
        if self._thread is not None:
            self._thread.join(KILL_AFTER_S)
        self._release_lock()

    # --- internals ------------------------------------------------------------------------------
    def _say(self, message):
        self._output(MESSAGE_PREFIX + message)

    def _acquire_lock(self):
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def _release_lock(self):
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)  # closing the only descriptor releases the flock

    def _read_token(self):
        try:
            token = self.token_path.read_text().strip()
        except FileNotFoundError:
            return None
        os.chmod(self.token_path, 0o600)
        return token or None

    def _write_token(self, token):
        staging = self.token_path.with_name(f".{TOKEN_FILE}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            staging.unlink()
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(token + "\n")
        os.replace(staging, self.token_path)

    def _launch(self):
        """Provision the worker, then spawn the agent unless stopping; return the process or None."""
        stored = self._read_token()
        token = self._provision(self.name, stored)
        if token != stored:
            self._write_token(token)
        (self.data_dir / JOBS_DIR).mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self._stopping.is_set():
                return None
            self._token = token
            self._process = self._popen(
                self.agent_argv(),
                env=self.agent_env(token),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # Ctrl-C in the terminal reaches the server only; stop() signals the agent
                # Killed with the server, even one killed -9: without its server it can neither take nor
                # report a job, and a restarted server provisions a new one (its trainer dies with it).
                preexec_fn=parent_death_signal(signal.SIGKILL),
            )
            self._spawned_at = self._clock()
            return self._process

    def _supervise(self, process, failure):
        """Echo the agent's output; start it again with backoff whenever it exits or fails to start."""
        while True:
            ran_for = 0
            if process is not None:
                self._echo(process)
                returncode = process.wait()
                if self._stopping.is_set():
                    return
                ran_for = self._clock() - self._spawned_at
                failure = f"agent {describe_exit(returncode)}"
            delay = self._backoff.delay(ran_for)
            self._say(f"{failure}; restarting in {delay:g} s")
            if self._stopping.wait(delay):
                return
            try:
                process = self._launch()
            except Exception as exc:  # any failure: report it and try again later; this thread never dies
                process, failure = None, f"could not start the agent ({_one_line(exc)})"
                continue
            if process is None:  # stop() came while provisioning
                return

    def _echo(self, process):
        """Print the agent's lines, prefixed, its token masked; hold back its first "cannot reach" lines
        (``LISTENER_GRACE_S``): dropped if it registers, printed if the refusals go on or it exits."""
        held = []  # None once the agent has registered or its grace has passed
        for raw in process.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            if self._token:
                line = line.replace(self._token, MASK)
            if held is not None:
                if REGISTERED_MARK in line:
                    held = None  # the server was only starting to listen: those refusals were no news
                elif self._clock() - self._spawned_at < self._listener_grace:
                    if UNREACHABLE_MARK in line:
                        held.append(line)
                        continue
                else:
                    for earlier in held:
                        self._output(OUTPUT_PREFIX + earlier)
                    held = None
            self._output(OUTPUT_PREFIX + line)
        for earlier in held or ():
            self._output(OUTPUT_PREFIX + earlier)
        process.stdout.close()

    @staticmethod
    def _waited(process, timeout):
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    @staticmethod
    def _kill(process):
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the agent leads its own process group
        except (ProcessLookupError, PermissionError):
            process.kill()
