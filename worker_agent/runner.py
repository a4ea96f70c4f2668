"""Runs one training job: its directory, its config files, its process group, its output and progress."""

import collections
import errno
import itertools
import json
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from . import progress as progress_protocol
from . import protocol
from . import supervisor
from .artifacts import MANIFEST_FILE, TransferError
from .supervisor import parent_death_signal  # noqa: F401 - the harnesses and the local worker use it from here

logger = logging.getLogger(__name__)

DEFAULT_COMMAND = (sys.executable, "-m", "simpletuner.train")
TAIL_LINES = 200  # kept in memory; the last REPORTED_TAIL_LINES are sent to the orchestrator
UNSENT_MAX_LINES = 20_000  # output lines kept until the orchestrator has them (older ones are then lost, and said so)
REPORTED_TAIL_LINES = 50
MAX_LINE_CHARS = 2000
FOLLOW_INTERVAL = 0.1  # how often the agent looks for new output in train.log, in seconds
CONFIG_FILE = "config.json"
DATALOADER_FILE = "multidatabackend.json"
LOG_FILE = "train.log"
# Environment the trainer must not inherit: the worker's own secrets.
SCRUBBED_ENV = ("SIMPLETUNER_WORKER_TOKEN",)
SUPERVISOR = os.path.abspath(supervisor.__file__)  # run by path, isolated: see supervisor.py

# Why the agent stopped a job: its own bookkeeping, never sent to the orchestrator. The first one wins.
STOP_CANCEL = "cancel"  # the orchestrator cancelled it: reported as cancelled
STOP_ABANDON = "abandon"  # no longer this worker's job: not reported at all
STOP_AGENT_EXIT = "agent_exit"  # the agent is exiting: disconnecting hands the job back to the queue
STOP_AGENT_DIED = "agent_died"  # the agent died and the supervisor stopped the trainer (supervisor.py)
STOP_FILE = "stop.json"  # why the agent stopped the attempt, for a restarted agent: {"attempt", "reason"}


def exit_code_field(code):
    """Return a Popen return code as a shell reports it (128+N for a signal)."""
    if code is None:
        return None
    return 128 - code if code < 0 else code


def exit_report(attempt, code, stop_reason, *, progress, log_tail, last_line):
    """Return the job report for an attempt that ended with ``code`` after ``stop_reason`` (None: not
    stopped), with its final ``progress``, ``log_tail`` and last line of output; or None when the end
    is no result to report.

    The one rule, for a trainer the agent watched end and for one a restarted agent finds recorded:
    abandoned → nothing; cancelled → ``cancelled``; exit 0 → ``completed``, even when the agent was
    stopping it (it finished first); stopped because the agent exits or died → nothing (the
    orchestrator requeues the job); any other code → ``failed``, with the last line of output.
    """
    if stop_reason == STOP_ABANDON:
        return None
    report = {"attempt": attempt, "exit_code": exit_code_field(code), "progress": progress or None, "log_tail": log_tail}
    if stop_reason == STOP_CANCEL:
        report.update(status=protocol.CANCELLED, error="cancelled by the orchestrator")
    elif code == 0:
        report.update(status=protocol.COMPLETED, error=None)
    elif stop_reason in (STOP_AGENT_EXIT, STOP_AGENT_DIED):
        return None
    else:
        error = f"Training {describe_exit(code)}"
        if last_line:
            error += f": {last_line}"
        report.update(status=protocol.FAILED, error=error)
    return report


def recorded_stop(job_dir, attempt):
    """Return why the agent stopped ``attempt`` in ``job_dir`` (``stop.json``), or None."""
    try:
        record = json.loads((Path(job_dir) / STOP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("attempt") != attempt:
        return None
    return record.get("reason")


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


def _config_key(config, name):
    """Return the config key ``name``, in the config's own style (``--x`` or ``x``)."""
    if name in config or f"--{name}" in config:
        return name if name in config else f"--{name}"
    dashed = any(str(key).startswith("--") for key in config)
    return f"--{name}" if dashed else name


def _dataloader_key(config):
    """Return the config key naming the dataloader file, in the config's own style (``--x`` or ``x``)."""
    return _config_key(config, "data_backend_config")


def split_lines(data):
    """Split trainer output into ``(complete lines, the rest)``; CR, LF and CRLF all end a line, and an
    over-long unterminated line is cut into a line of its own."""
    *lines, rest = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    if len(rest) > MAX_LINE_CHARS * 4:
        lines.append(rest)
        rest = b""
    return lines, rest


class Output:
    """A trainer's output as the agent reports it: ``SIMPLETUNER_PROGRESS`` lines folded into
    ``progress``, the other lines kept as a tail. ``version`` changes with every change. Not locked."""

    def __init__(self):
        self.progress = {}
        self.version = 0
        self.tail = collections.deque(maxlen=TAIL_LINES)
        self.lines_total = 0  # output lines so far (progress lines not counted)
        self.unsent = collections.deque(maxlen=UNSENT_MAX_LINES)  # the last lines not yet accepted

    def add(self, raw):
        """Fold one line of output (bytes, any encoding: invalid UTF-8 is replaced)."""
        text = raw.decode("utf-8", errors="replace").rstrip()
        update = progress_protocol.parse_line(text)
        if update is not None:
            self.progress = progress_protocol.merge(self.progress, update)
        elif text.strip():
            self.tail.append(text[:MAX_LINE_CHARS])
            self.unsent.append(text[:MAX_LINE_CHARS])
            self.lines_total += 1
        else:
            return
        self.version += 1

    def log_chunk(self, max_lines=protocol.LOG_CHUNK_MAX_LINES):
        """Return the oldest unsent lines as ``protocol.LogLines`` (None when all were accepted)."""
        if not self.unsent:
            return None
        first = self.lines_total - len(self.unsent)
        return {protocol.LOG_LINES_FROM: first, "lines": list(itertools.islice(self.unsent, max_lines))}

    def log_sent(self, upto):
        """Forget the lines numbered below ``upto``: the orchestrator accepted them."""
        first = self.lines_total - len(self.unsent)
        for _ in range(max(0, min(upto - first, len(self.unsent)))):
            self.unsent.popleft()

    def log_tail(self, lines=REPORTED_TAIL_LINES):
        return "\n".join(list(self.tail)[-lines:])

    def last_line(self):
        return self.tail[-1] if self.tail else ""


def read_log(job_dir, *, max_bytes=1 << 20):
    """Return the ``Output`` of the last ``max_bytes`` of ``<job_dir>/train.log`` (empty if there is none):
    what a restarted agent knows of a trainer that ended while no agent was watching."""
    output = Output()
    try:
        with open(Path(job_dir) / LOG_FILE, "rb") as fh:
            size = fh.seek(0, os.SEEK_END)
            fh.seek(max(size - max_bytes, 0))
            data = fh.read()
    except OSError:
        return output
    if size > max_bytes:
        data = data.split(b"\n", 1)[-1]  # the first line read is likely cut
    lines, rest = split_lines(data)
    for line in [*lines, rest] if rest else lines:
        output.add(line)
    return output


class JobRun:
    """One attempt of one job on this node.

    ``prepare()`` writes ``<work_dir>/<job_id>/config.json`` (and the dataloader config), ``start()``
    runs the command in its own process group with ``CONFIG_PATH``, ``SIMPLETUNER_CONFIG_BACKEND=json``
    and ``SIMPLETUNER_JOB_ID`` set, and a reader thread tees its merged output to ``train.log``, keeps
    a tail, and folds ``SIMPLETUNER_PROGRESS`` lines into ``progress``. ``on_exit(run)`` is called
    from the waiter thread when the process ends. ``stop(reason)`` ends it: SIGTERM to the group,
    SIGKILL after ``grace`` seconds.
    """

    def __init__(
        self, *, job_id, attempt, config, dataloader, work_dir, command, on_exit, grace=30.0, clock=time.monotonic,
        transfer=None, resume=None,
    ):  # fmt: skip
        self.job_id = str(job_id)
        self.transfer = transfer  # artifacts.ArtifactTransfer of this attempt, or None (no artifact store)
        self.resume = resume  # the protocol.ResumeCheckpoint to start from, or None
        self.upload_error = None  # why the output directory could not be uploaded, if it could not
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
        self.output = Output()
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._ended = threading.Event()  # the process has ended: the reader reads to the end and stops

    # --- set-up -------------------------------------------------------------------------------

    def output_dir(self):
        """The declared output directory: the config's ``output_dir`` (relative to the job directory, where the
        trainer runs), else ``<job dir>/output``."""
        raw = self.config.get(_config_key(self.config, protocol.OUTPUT_DIR_CONFIG_KEY))
        path = Path(str(raw)) if raw else self.job_dir / "output"
        return path if path.is_absolute() else self.job_dir / path

    def prepare(self):
        """Create the job directory, fetch the checkpoint to resume from, and write the config files; return
        the config path. Raise TransferError if the checkpoint cannot be fetched."""
        self.job_dir.mkdir(parents=True, exist_ok=True)
        config = dict(self.config)
        if self.transfer is not None:
            output = self.output_dir()
            output.mkdir(parents=True, exist_ok=True)
            config[_config_key(config, protocol.OUTPUT_DIR_CONFIG_KEY)] = str(output)
            if self.resume:
                self.transfer.download_checkpoint(self.resume, output, manifest_path=self.job_dir / MANIFEST_FILE)
                config[_config_key(config, protocol.RESUME_CONFIG_KEY)] = self.resume["checkpoint"]
                logger.info("job %s: resuming from %s (step %s)", self.job_id, self.resume["checkpoint"], self.resume["step"])
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
        if self.transfer is not None:  # as SimpleTuner's trainer reads them (and uploads there itself)
            env[protocol.UPLOAD_ENDPOINT_ENV] = self.transfer.endpoint_url
            env[protocol.UPLOAD_TOKEN_ENV] = self.transfer.token
        return env

    def supervised_command(self):
        """The argv that runs the trainer under its supervisor (which records its exit: supervisor.py)."""
        return [sys.executable, "-I", SUPERVISOR, "--grace", f"{self.grace:g}", "--", *self.command]

    def start(self):
        """Prepare and start the trainer; raise OSError (e.g. command not found) if it cannot start.

        The process started is the trainer's supervisor, which leads the job's process group, runs the
        trainer in it, writes ``exit.json`` when it ends, and exits as it did.
        """
        check_command(self.command)
        config_path = self.prepare()
        supervisor.settle(self.job_dir)  # an earlier attempt's records, handled at start-up: not this one's
        (self.job_dir / STOP_FILE).unlink(missing_ok=True)
        # The trainer writes its output straight to train.log, and the agent follows the file: what the
        # trainer printed is on disk whatever happens to the agent (a restarted one reads it back).
        log_path = self.job_dir / LOG_FILE
        with open(log_path, "ab") as log:
            offset = log.tell()
            self.process = subprocess.Popen(
                self.supervised_command(),
                cwd=self.job_dir,
                env=self.environment(config_path),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: signals reach the whole tree
                preexec_fn=parent_death_signal(supervisor.PARENT_DEATH_SIGNAL),
            )
        self.started_at = self._clock()
        reader = threading.Thread(target=self._follow, args=(log_path, offset), name=f"job-{self.job_id}-output", daemon=True)
        reader.start()
        threading.Thread(target=self._wait, args=(reader,), name=f"job-{self.job_id}-wait", daemon=True).start()
        return self

    # --- output -------------------------------------------------------------------------------

    def _follow(self, log_path, offset):
        """Follow train.log from ``offset`` (this attempt's first byte) until the process has ended and
        everything it wrote is read, folding each line into the output."""
        pending = b""
        try:
            with open(log_path, "rb") as log:
                log.seek(offset)
                while True:
                    chunk = log.read(65536)
                    if chunk:
                        lines, pending = split_lines(pending + chunk)
                        for line in lines:
                            self._line(line)
                    elif self._ended.is_set():
                        break  # ended, and read to the end of the file after that
                    else:
                        self._ended.wait(FOLLOW_INTERVAL)
        except OSError as exc:
            logger.warning("job %s: reading its output stopped: %s", self.job_id, exc)
        if pending:
            self._line(pending)

    def _line(self, raw):
        with self._lock:
            self.output.add(raw)

    def log_tail(self, lines=REPORTED_TAIL_LINES):
        """Return the last ``lines`` lines of output (progress lines excluded)."""
        with self._lock:
            return self.output.log_tail(lines)

    def last_line(self):
        with self._lock:
            return self.output.last_line()

    def log_chunk(self):
        with self._lock:
            return self.output.log_chunk()

    def log_sent(self, chunk):
        """Record that the orchestrator accepted ``chunk`` (from ``log_chunk``)."""
        if chunk:
            with self._lock:
                self.output.log_sent(chunk[protocol.LOG_LINES_FROM] + len(chunk["lines"]))

    def snapshot(self):
        """Return ``(progress, version)`` consistently."""
        with self._lock:
            return dict(self.output.progress), self.output.version

    # --- lifecycle ----------------------------------------------------------------------------

    def _wait(self, reader):
        self.returncode = self.process.wait()
        self._signal(signal.SIGTERM)  # children the trainer left behind would hold GPU memory
        self._ended.set()
        reader.join(timeout=5)
        if self.returncode == 0 and self.stop_reason is None and self.transfer is not None:
            self._upload_outputs()
        self.finished_at = self._clock()
        self._stopping.set()
        self._on_exit(self)

    def _upload_outputs(self):
        """Upload the output directory (before the result is reported); record why not in ``upload_error``."""
        try:
            sent = self.transfer.upload_dir(self.output_dir(), manifest_path=self.job_dir / MANIFEST_FILE)
        except TransferError as exc:
            if exc.status is None:  # unreachable: the result is reported (or journaled) as it is; the files stay here
                logger.warning("job %s: outputs not uploaded (%s); they stay in %s", self.job_id, exc, self.output_dir())
            else:  # refused (quota, size, key): the job did not deliver its outputs
                self.upload_error = str(exc)
                logger.error("job %s: its outputs could not be uploaded: %s", self.job_id, exc)
        except OSError as exc:
            self.upload_error = str(exc)
            logger.error("job %s: its outputs could not be uploaded: %s", self.job_id, exc)
        else:
            logger.info("job %s: %d output file(s) uploaded", self.job_id, sent)

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
            try:  # for a restarted agent, should this one die before it handles the trainer's end
                _write_json(self.job_dir / STOP_FILE, {"attempt": self.attempt, "reason": reason})
            except OSError as exc:
                logger.warning("job %s: could not record why it was stopped: %s", self.job_id, exc)
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


def check_command(command):
    """Raise OSError (ENOENT or EACCES, as exec would) if ``command``'s program cannot be run."""
    program = command[0]
    if os.sep in program:
        if not os.path.exists(program):
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        if os.path.isdir(program) or not os.access(program, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
    elif shutil.which(program) is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)


def _write_json(path, data):
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=False))
    os.replace(tmp, path)
