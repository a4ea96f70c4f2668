"""Runs one training job: its directory, its config files, its process group, its output and progress."""

import errno
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

from . import checkpoints
from . import layout, protocol, supervisor, webhooks
from . import progress as progress_protocol
from .artifacts import MANIFEST_FILE, TransferError
from .output import ERROR_FILE, LOG_FILE, REPORTED_TAIL_LINES, Output, read_log, split_lines, write_error  # noqa: F401 - read_log: journal.py
from .supervisor import parent_death_signal  # noqa: F401 - the harnesses and the local worker use it from here

logger = logging.getLogger(__name__)

DEFAULT_COMMAND = (sys.executable, "-m", "simpletuner.train")
FOLLOW_INTERVAL = 0.1  # how often the agent looks for new output in train.log, in seconds
CONFIG_FILE = "config.json"
DATALOADER_FILE = "multidatabackend.json"
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


def placement_config(config, placement):
    """Return the config keys a job's ``placement`` (its job_submit's PLACEMENT_FIELDS, or None) sets, named in
    ``config``'s own key style: with ``gpu_indices``, SimpleTuner's ``accelerate_visible_devices`` (the indices,
    comma-joined) and ``num_processes`` (their count x ``num_nodes``); for a multi-node job, its machines and
    rendezvous (``protocol.GANG_CONFIG_KEYS``) and ``same_network``. Nothing without a placement."""
    placement = placement or {}
    nodes = placement.get("num_nodes") or 1
    keys = {}
    indices = placement.get("gpu_indices")
    if indices is not None:
        keys[protocol.VISIBLE_DEVICES_CONFIG_KEY] = ",".join(str(index) for index in indices)
        keys[protocol.NUM_PROCESSES_CONFIG_KEY] = len(indices) * nodes
    if nodes > 1:
        for field, name in protocol.GANG_CONFIG_KEYS.items():
            keys[name] = placement[field]
        keys[protocol.SAME_NETWORK_CONFIG_KEY] = True
    return {layout.config_key(config, name): value for name, value in keys.items()}


# Not sent by the orchestrator: the agent's own placement of a job given the whole worker while ``--gpus`` restricts
# it to some of the node's GPUs: the trainer sees those alone (its config is left as it is).
WORKER_GPUS = "worker_gpus"


def placement_env(placement):
    """Return the environment a job's ``placement`` sets: ``CUDA_VISIBLE_DEVICES`` (with ``CUDA_DEVICE_ORDER``
    PCI_BUS_ID, so that CUDA numbers the GPUs as NVML does) for its ``gpu_indices`` (else the ``WORKER_GPUS``
    of a whole worker restricted by ``--gpus``), and for a multi-node job the rendezvous as torchrun names it
    (``protocol.GANG_ENV``). Nothing without a placement."""
    placement = placement or {}
    env = {}
    indices = placement.get("gpu_indices")
    if indices is None:
        indices = placement.get(WORKER_GPUS)
    if indices is not None:
        env[protocol.VISIBLE_DEVICES_ENV] = ",".join(str(index) for index in indices)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    if (placement.get("num_nodes") or 1) > 1:
        env.update({name: str(placement[field]) for field, name in protocol.GANG_ENV.items()})
    return env


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


class JobRun:
    """One attempt of one job on this node.

    ``prepare()`` writes ``<work_dir>/<job_id>/config.json`` (and the dataloader config), with the job's
    own output and cache directories (``layout.py``), a webhook entry for the agent's receiver
    (``webhooks.py``) and where it runs (``placement``: ``placement_config``); ``start()`` runs the command in its own process group with ``CONFIG_PATH``,
    ``SIMPLETUNER_CONFIG_BACKEND=json``, ``SIMPLETUNER_JOB_ID`` and ``placement_env`` set, and a reader thread tees its
    merged output to ``train.log``, keeps a tail, and folds ``SIMPLETUNER_PROGRESS`` lines, like the
    trainer's webhook events, into ``progress`` (``output.py``). ``on_exit(run)`` is called from the
    waiter thread when the process ends. ``stop(reason)`` ends it: SIGTERM to the group, SIGKILL after
    ``grace`` seconds.
    """

    def __init__(
        self, *, job_id, attempt, config, dataloader, work_dir, command, on_exit, grace=30.0, clock=time.monotonic,
        transfer=None, resume=None, placement=None,
    ):  # fmt: skip
        self.job_id = str(job_id)
        self.transfer = transfer  # artifacts.ArtifactTransfer of this attempt, or None (no artifact store)
        self.resume = resume  # the protocol.ResumeCheckpoint to start from, or None
        self.placement = placement  # the job_submit's GPUs and rendezvous (jobs.PLACEMENT_FIELDS), or None
        self.upload_error = None  # why the output directory could not be uploaded, if it could not
        self.watcher = None  # the checkpoints.CheckpointWatcher uploading finished checkpoints while it runs
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
        self.receiver = None  # the webhooks.WebhookReceiver of the trainer's events while it runs
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._ended = threading.Event()  # the process has ended: the reader reads to the end and stops

    # --- set-up -------------------------------------------------------------------------------

    def output_dir(self):
        """The job's output directory, ``<job dir>/output``, whatever the config says (``layout.py``)."""
        return self.job_dir / layout.OUTPUT_DIR

    def prepare(self):
        """Create the job directory, fetch the checkpoint to resume from, and write the config files; return
        the config path. Raise TransferError if the checkpoint cannot be fetched.

        The config written names the job's own output directory and caches, whatever it said, and its
        dataloader (given with the job, else the file its config names) is written into the job directory
        with its caches made the job's own too.
        """
        self.job_dir.mkdir(parents=True, exist_ok=True)
        config = layout.own_config(self.config, self.job_dir)
        config.update(placement_config(config, self.placement))
        output = self.output_dir()
        output.mkdir(parents=True, exist_ok=True)
        if self.transfer is not None and self.resume:
            self.transfer.download_checkpoint(self.resume, output, manifest_path=self.job_dir / MANIFEST_FILE)
            config[layout.config_key(config, protocol.RESUME_CONFIG_KEY)] = self.resume["checkpoint"]
            logger.info("job %s: resuming from %s (step %s)", self.job_id, self.resume["checkpoint"], self.resume["step"])
        dataloader = self.dataloader if self.dataloader is not None else self._dataloader_of(config)
        if dataloader is not None:
            loader_path = self.job_dir / DATALOADER_FILE
            _write_json(loader_path, layout.own_dataloader(dataloader, self.job_dir))
            config[layout.config_key(config, "data_backend_config")] = str(loader_path)
        if self.receiver is not None:
            key = layout.config_key(config, webhooks.CONFIG_KEY)
            merged = webhooks.with_entry(config.get(key), self.receiver.config_entry(), self.job_dir)
            if merged is None:
                logger.warning("job %s: its webhook_config cannot be read; the trainer's webhook events will not reach the agent", self.job_id)
            else:
                config[key] = merged
        config_path = self.job_dir / CONFIG_FILE
        _write_json(config_path, config, private=True)  # it holds the receiver's secret (and maybe the user's)
        return config_path

    def _dataloader_of(self, config):
        """Return the dataloader in the file the config names (relative to the job directory), or None."""
        for key in ("data_backend_config", "--data_backend_config"):
            raw = config.get(key)
            if isinstance(raw, str) and raw.strip():
                path = self.job_dir / os.path.expanduser(raw.strip())
                try:
                    return json.loads(path.read_text(encoding="utf-8"))
                except (OSError, ValueError) as exc:
                    logger.warning("job %s: its dataloader config %s cannot be read (%s); its caches stay as it says", self.job_id, path, exc)
        return None

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
        env.update(placement_env(self.placement))
        if self.transfer is not None:  # as SimpleTuner's trainer reads them (and uploads there itself)
            env[protocol.UPLOAD_ENDPOINT_ENV] = self.transfer.endpoint_url
            env[protocol.UPLOAD_TOKEN_ENV] = self.transfer.token
        return env

    def supervised_command(self):
        """The argv that runs the trainer under its supervisor (which records its exit: supervisor.py)."""
        return [sys.executable, "-I", SUPERVISOR, "--grace", f"{self.grace:g}", "--agent-pid", str(os.getpid()), "--", *self.command]

    def start(self):
        """Prepare and start the trainer; raise OSError (e.g. command not found) if it cannot start.

        The process started is the trainer's supervisor, which leads the job's process group, runs the
        trainer in it, writes ``exit.json`` when it ends, and exits as it did.
        """
        check_command(self.command)
        self._open_receiver()
        try:
            config_path = self.prepare()
        except BaseException:
            self._close_receiver()
            raise
        supervisor.settle(self.job_dir)  # an earlier attempt's records, handled at start-up: not this one's
        (self.job_dir / STOP_FILE).unlink(missing_ok=True)
        (self.job_dir / ERROR_FILE).unlink(missing_ok=True)
        if self.resume and checkpoints.reaches_final_step(self.config, self.resume.get("step")):
            return self._finish_from_checkpoint()
        if self.transfer is not None:  # checkpoints marked finished before the trainer starts are not its own
            self.watcher = checkpoints.CheckpointWatcher(
                job_id=self.job_id, output_dir=self.output_dir(), transfer=self.transfer, manifest_path=self.job_dir / MANIFEST_FILE
            )
        # The trainer writes its output straight to train.log, and the agent follows the file: what the
        # trainer printed is on disk whatever happens to the agent (a restarted one reads it back).
        log_path = self.job_dir / LOG_FILE
        with open(log_path, "ab") as log:
            offset = log.tell()
            try:
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
            except BaseException:
                self._close_receiver()
                raise
        self.started_at = self._clock()
        if self.watcher is not None:
            self.watcher.start()
        reader = threading.Thread(target=self._follow, args=(log_path, offset), name=f"job-{self.job_id}-output", daemon=True)
        reader.start()
        threading.Thread(target=self._wait, args=(reader,), name=f"job-{self.job_id}-wait", daemon=True).start()
        return self

    # --- the trainer's webhook events ---------------------------------------------------------

    def _open_receiver(self):
        """Start the receiver of the trainer's webhook events; without one (it cannot bind) the job runs on."""
        receiver = webhooks.WebhookReceiver(self._event, name=f"job-{self.job_id}-webhooks")
        try:
            self.receiver = receiver.start()
        except OSError as exc:
            logger.warning("job %s: no receiver for the trainer's webhook events (%s); progress comes from its output only", self.job_id, exc)

    def _close_receiver(self):
        if self.receiver is not None:
            self.receiver.stop()
            self.receiver = None

    def _event(self, payload):
        """One webhook event of the trainer (the receiver's thread): folded into the output."""
        with self._lock:
            error = self.output.error
            stage = self.output.event(payload)
            if self.output.error != error:
                write_error(self.job_dir, self.output)
        if stage is not None:
            logger.info("Job %s: %s", self.job_id, progress_protocol.format_stage(stage))

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
        """Return the line that sums up the output (``Output.last_line``: the trainer's error event, a
        traceback's exception, else the last line that says something)."""
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
        self._finish()

    def _finish(self):
        """After the trainer: its last checkpoints and its outputs uploaded, then ``on_exit``."""
        self._close_receiver()
        if self.watcher is not None:
            self.watcher.stop()
        if self.returncode == 0 and self.stop_reason is None and self.transfer is not None:
            self._upload_outputs()
        self.finished_at = self._clock()
        self._stopping.set()
        self._on_exit(self)

    def _finish_from_checkpoint(self):
        """The checkpoint resumed from is the run's final step: no trainer runs (it would train one step past
        it); the checkpoint's weights are the run's output, uploaded, and the attempt ends with exit 0."""
        for line in checkpoints.adopt_final_checkpoint(self.job_id, self.resume, self.output_dir()):
            self._line(line)
        self.started_at = self._clock()
        self.returncode = 0
        threading.Thread(target=self._finish, name=f"job-{self.job_id}-finish", daemon=True).start()
        return self

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
        if self.process is None:
            return  # no trainer was started (finished from its checkpoint)
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


def _write_json(path, data, *, private=False):
    """Write ``data`` to ``path`` (replaced whole); ``private``: readable by this user only."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(json.dumps(data, indent=2, sort_keys=False))
    os.replace(tmp, path)
