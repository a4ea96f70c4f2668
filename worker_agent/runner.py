"""Runs one training job: its directory, its config files, its process group, its output and progress."""

import collections
import ctypes
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import progress as progress_protocol

logger = logging.getLogger(__name__)

DEFAULT_COMMAND = (sys.executable, "-m", "simpletuner.train")
TAIL_LINES = 200  # kept in memory; the last REPORTED_TAIL_LINES are sent to the orchestrator
REPORTED_TAIL_LINES = 50
MAX_LINE_CHARS = 2000
CONFIG_FILE = "config.json"
DATALOADER_FILE = "multidatabackend.json"
LOG_FILE = "train.log"
# Environment the trainer must not inherit: the worker's own secrets.
SCRUBBED_ENV = ("SIMPLETUNER_WORKER_TOKEN",)
PR_SET_PDEATHSIG = 1

# Why the agent stopped a job: its own bookkeeping, never sent to the orchestrator. The first one wins.
STOP_CANCEL = "cancel"  # the orchestrator cancelled it: reported as cancelled
STOP_ABANDON = "abandon"  # no longer this worker's job: not reported at all
STOP_AGENT_EXIT = "agent_exit"  # the agent is exiting: disconnecting hands the job back to the queue


def parse_command(raw):
    """Return the training command as an argv list: ``raw`` split like a shell would, or the default.

    A relative program path (``.venv/bin/python``, ``./train.sh``) means relative to where the agent
    was started, not to the job directory the trainer runs in.
    """
    if not raw:
        return list(DEFAULT_COMMAND)
    argv = shlex.split(raw)
    if not argv:
        raise ValueError("the training command is empty")
    if "/" in argv[0] and not os.path.isabs(argv[0]):
        argv[0] = os.path.abspath(argv[0])
    return argv


def describe_exit(code):
    """Return "exited with code N" or "killed by SIGKILL" for a Popen return code."""
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _dataloader_key(config):
    """Return the config key naming the dataloader file, in the config's own style (``--x`` or ``x``)."""
    dashed = any(str(key).startswith("--") for key in config)
    return "--data_backend_config" if dashed else "data_backend_config"


class JobRun:
    """One attempt of one job on this node.

    ``prepare()`` writes ``<work_dir>/<job_id>/config.json`` (and the dataloader config), ``start()``
    runs the command in its own process group with ``CONFIG_PATH``, ``SIMPLETUNER_CONFIG_BACKEND=json``
    and ``SIMPLETUNER_JOB_ID`` set, and a reader thread tees its merged output to ``train.log``, keeps
    a tail, and folds ``SIMPLETUNER_PROGRESS`` lines into ``progress``. ``on_exit(run)`` is called
    from the waiter thread when the process ends. ``stop(reason)`` ends it: SIGTERM to the group,
    SIGKILL after ``grace`` seconds.
    """

    def __init__(self, *, job_id, attempt, config, dataloader, work_dir, command, on_exit, grace=30.0, clock=time.monotonic):
        self.job_id = str(job_id)
        self.attempt = attempt
        self.config = dict(config or {})
        self.dataloader = dataloader
        self.job_dir = Path(work_dir) / self.job_id
        self.command = list(command)
        self.grace = grace
        self._on_exit = on_exit
        self._clock = clock
        self.process = None
        self.returncode = None
        self.stop_reason = None  # None, or why we stopped it: one of the STOP_* reasons
        self.started_at = None
        self.finished_at = None
        self.progress = {}
        self.progress_version = 0  # bumped on every progress or output change
        self._tail = collections.deque(maxlen=TAIL_LINES)
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    # --- set-up -------------------------------------------------------------------------------

    def prepare(self):
        """Create the job directory and write the config files; return the config path."""
        self.job_dir.mkdir(parents=True, exist_ok=True)
        config = dict(self.config)
        if self.dataloader is not None:
            loader_path = self.job_dir / DATALOADER_FILE
            _write_json(loader_path, self.dataloader)
            config[_dataloader_key(config)] = str(loader_path)
        config_path = self.job_dir / CONFIG_FILE
        _write_json(config_path, config)
        return config_path

    def environment(self, config_path):
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED_ENV}
        env.update(
            {
                "CONFIG_PATH": str(config_path),
                "SIMPLETUNER_CONFIG_BACKEND": "json",
                "SIMPLETUNER_JOB_ID": self.job_id,
                "SIMPLETUNER_JOB_DIR": str(self.job_dir),
                "SIMPLETUNER_ATTEMPT": str(self.attempt or ""),
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def start(self):
        """Prepare and start the trainer; raise OSError (e.g. command not found) if it cannot start."""
        config_path = self.prepare()
        log = open(self.job_dir / LOG_FILE, "ab")  # noqa: SIM115 - closed by the reader thread
        try:
            self.process = subprocess.Popen(
                self.command,
                cwd=self.job_dir,
                env=self.environment(config_path),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: signals reach the whole tree
                preexec_fn=parent_death_signal(),
            )
        except BaseException:
            log.close()
            raise
        self.started_at = self._clock()
        reader = threading.Thread(target=self._read, args=(log,), name=f"job-{self.job_id}-output", daemon=True)
        reader.start()
        threading.Thread(target=self._wait, args=(reader,), name=f"job-{self.job_id}-wait", daemon=True).start()
        return self

    # --- output -------------------------------------------------------------------------------

    def _read(self, log):
        fd = self.process.stdout.fileno()
        pending = b""
        try:
            while True:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                log.write(chunk)
                log.flush()
                pending += chunk
                *lines, pending = pending.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
                for line in lines:
                    self._line(line)
                if len(pending) > MAX_LINE_CHARS * 4:
                    self._line(pending)
                    pending = b""
            if pending:
                self._line(pending)
        except OSError as exc:
            logger.debug("job %s: output read ended: %s", self.job_id, exc)
        finally:
            log.close()
            self.process.stdout.close()

    def _line(self, raw):
        text = raw.decode("utf-8", errors="replace").rstrip()
        update = progress_protocol.parse_line(text)
        with self._lock:
            if update is not None:
                self.progress = progress_protocol.merge(self.progress, update)
            elif text.strip():
                self._tail.append(text[:MAX_LINE_CHARS])
            else:
                return
            self.progress_version += 1

    def log_tail(self, lines=REPORTED_TAIL_LINES):
        """Return the last ``lines`` lines of output (progress lines excluded)."""
        with self._lock:
            return "\n".join(list(self._tail)[-lines:])

    def last_line(self):
        with self._lock:
            return self._tail[-1] if self._tail else ""

    def snapshot(self):
        """Return ``(progress, version)`` consistently."""
        with self._lock:
            return dict(self.progress), self.progress_version

    # --- lifecycle ----------------------------------------------------------------------------

    def _wait(self, reader):
        self.returncode = self.process.wait()
        self._signal(signal.SIGTERM)  # children the trainer left behind would hold GPU memory
        reader.join(timeout=5)
        self.finished_at = self._clock()
        self._stopping.set()
        self._on_exit(self)

    def wait(self, timeout=None):
        """Wait up to ``timeout`` seconds for the process to end; return whether it has."""
        return self._stopping.wait(timeout)

    @property
    def running(self):
        return self.process is not None and self.returncode is None

    def stop(self, reason, *, grace=None):
        """Stop the trainer for ``reason`` (a STOP_* value; the first one wins): SIGTERM now, SIGKILL after grace.

        Return at once; the process's end arrives through ``on_exit``.
        """
        if self.stop_reason is None:
            self.stop_reason = reason
        if not self.running:
            return
        self._signal(signal.SIGTERM)
        grace = self.grace if grace is None else grace
        threading.Thread(target=self._kill_after, args=(grace,), name=f"job-{self.job_id}-kill", daemon=True).start()

    def kill(self):
        """SIGKILL the whole process group now."""
        self._signal(signal.SIGKILL)

    def _kill_after(self, grace):
        if not self._stopping.wait(grace) and self.running:
            logger.warning("job %s: still running %ss after SIGTERM; sending SIGKILL", self.job_id, grace)
            self.kill()

    def _signal(self, signum):
        try:
            os.killpg(self.process.pid, signum)
        except ProcessLookupError:
            pass
        except PermissionError as exc:
            logger.warning("job %s: cannot signal its process group: %s", self.job_id, exc)


def parent_death_signal(sig=signal.SIGTERM):
    """Return a preexec_fn making Linux send ``sig`` to the child when its parent dies, or None elsewhere.

    A trainer whose agent is gone (kill -9 included) can report nothing and its job is requeued
    elsewhere: it must not keep the GPU busy. Linux ties the signal to the *thread* that forked, so
    the child must be spawned by a thread that lives as long as the child (the agent's main thread).
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def set_parent_death_signal():
        prctl(PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return set_parent_death_signal


def _write_json(path, data):
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False))
    os.replace(tmp, path)
