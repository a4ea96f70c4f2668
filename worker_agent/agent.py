"""The agent's main loop: register, hold the stream, heartbeat, run one job at a time, report, reconnect.

All state lives on the main thread. The stream reader, the job's waiter and the signal handlers only
post messages to its queue, so every decision (start, stop, report, exit) is taken in one place.

Rules (README, "The worker agent"):
- A job is acknowledged with ``starting`` before its process starts; a refusal (409) skips it, so a
  replayed or stale dispatch never runs. ``running`` follows once the process is up, then progress
  (at most once a second), then exactly one terminal report, retried until the orchestrator answers.
- A 409 on any report or heartbeat naming our job means it is no longer ours: the process is stopped
  and nothing more is reported for it (``abandon``).
- After the stream drops, the agent registers again, reporting the job it runs (``resume_job`` keeps
  it, ``abandon_job`` stops it), then reopens the stream with Last-Event-ID.
- First SIGTERM/SIGINT: take no new job, let the running one finish and report it, disconnect, exit 0.
  Second: stop the job now and disconnect (the orchestrator requeues the job by its retry rules and
  takes the worker offline in the same step), exit 0. Third: kill the job and exit at once (status 1).
- Ephemeral: exit 0 after one job is reported, or when drained while idle. Persistent: stay.

This module holds the loop, the message dispatch, drain, signals and exit. The Agent class composes
the session (registration, heartbeats, reconnecting, the stream reader: session.py) and the job's life
(jobs.py); both are mixins of methods over the state declared in ``Agent.__init__``.
"""

import importlib.util
import logging
import queue
import signal
import threading
import time

from . import __version__, protocol
from .backoff import Backoff
from .client import AgentError, FatalError, OrchestratorClient
from .gpu import GpuMonitor, describe
from .jobs import PROGRESS_REPORT_INTERVAL, JobsMixin
from .runner import STOP_AGENT_EXIT, JobRun, parse_command
from .session import SessionMixin, StreamReader

logger = logging.getLogger("worker_agent")

# What to do after the orchestrator ended this worker's stream for good, by the shutdown event's ``code``.
SHUTDOWN_FIXES = {
    protocol.TOKEN_REVOKED: "request a new token (admin → Workers → rotate token) and restart the agent with it",
    protocol.WORKER_DELETED: (
        "this worker was deleted: create a new one (admin → Workers) and start the agent with its token"
    ),
}


class Agent(SessionMixin, JobsMixin):
    """One worker agent process. ``run()`` returns the exit status.

    ``client``, ``monitor``, ``clock``, ``run_factory`` and ``stream`` are injectable for tests.
    """

    def __init__(self, config, *, client=None, monitor=None, clock=time.monotonic, run_factory=JobRun, stream=None):
        self.config = config
        self.client = client or OrchestratorClient(config.orchestrator_url, config.token, verify=config.verify)
        self.monitor = monitor or GpuMonitor()
        self.clock = clock
        self.run_factory = run_factory
        self.command = parse_command(config.command)
        self.inbox = queue.Queue()
        self.stream = stream or StreamReader(self.client, self.inbox.put)
        self.register_backoff = Backoff()
        self.report_backoff = Backoff(cap=30.0)
        self.heartbeat_interval = config.heartbeat_interval or 30.0
        self.capabilities = {}
        self.worker_id = None
        self.registered = False
        self.ever_registered = False
        self.register_due = None
        self.next_heartbeat = None
        self.heartbeat_failing = False
        self.unreachable_since = None
        self.job = None  # the JobRun in progress
        self.pending_report = None  # (job_id, body) of a finished job whose result is not delivered yet
        self.report_due = None
        self.waiting = []  # job_submit payloads that arrived while busy
        self.finished_attempts = []
        self.last_progress_report = None
        self.reported_version = -1
        self.last_console = None
        self.console_version = -1
        self.draining = False
        self.signals = 0
        self.exit_code = None
        self.jobs_reported = 0

    # --- entry point --------------------------------------------------------------------------

    def run(self):
        """Run until told to stop; return the exit status (0 graceful, 1 fatal)."""
        self._install_signal_handlers()
        self._start_up()
        self.stream.start()
        try:
            while self.exit_code is None:
                self.tick()
                if self.exit_code is not None:
                    break
                try:
                    message = self.inbox.get(timeout=self._wait_time())
                except queue.Empty:
                    continue
                self.handle(message)
        finally:
            self._shut_down()
        return self.exit_code

    def _start_up(self):
        mode = "persistent" if self.config.persistent else "ephemeral (exits after one job)"
        logger.info("SimpleTuner worker agent %s: %s, %s", __version__, self.config.name, mode)
        self.capabilities = self.monitor.capabilities()
        logger.info("Accelerators: %s", describe(self.capabilities))
        if self.config.command is None and importlib.util.find_spec("simpletuner") is None:
            logger.warning(
                "SimpleTuner is not installed in this Python (%s), so jobs will fail with the default "
                "training command. Install simpletuner here, or pass --command / SIMPLETUNER_WORKER_COMMAND.",
                self.command[0],
            )
        logger.info("Training command: %s", " ".join(self.command))
        logger.info("Job directories: %s", self.config.work_dir)
        logger.info("Connecting to %s", self.config.orchestrator_url)
        self.register_due = self.clock()

    def _shut_down(self):
        if self.job is not None and self.job.running:
            grace = min(self.config.cancel_grace, 10.0)
            self.job.stop(STOP_AGENT_EXIT, grace=grace)
            self.job.wait(grace + 5)
        self.stream.stop()
        self.monitor.close()
        self.client.close()

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda number, frame: self.inbox.put(("signal", number)))

    def _wait_time(self):
        now = self.clock()
        due = [t for t in (self.register_due, self.next_heartbeat, self.report_due) if t is not None]
        if self.job is not None:
            due.append((self.last_progress_report or now) + PROGRESS_REPORT_INTERVAL)
        if not due:
            return 1.0
        return min(max(min(due) - now, 0.01), 1.0)

    # --- timers -------------------------------------------------------------------------------

    def tick(self):
        """Do whatever is due: register, heartbeat, progress, a pending result."""
        now = self.clock()
        if self.register_due is not None and now >= self.register_due:
            self.register()
        if self.exit_code is None and self.next_heartbeat is not None and now >= self.next_heartbeat:
            self.heartbeat()
        if self.exit_code is None and self.pending_report is not None and self.report_due is not None and now >= self.report_due:
            self.deliver_report()
        if self.exit_code is None and self.job is not None and self.job.running:
            self.report_progress()
            self._console_progress()

    # --- messages -----------------------------------------------------------------------------

    def handle(self, message):
        kind = message[0]
        if kind == "sse":
            self.on_event(message[1])
        elif kind == "job_exited":
            self.on_job_exit(message[1])
        elif kind == "stream_lost":
            self.on_stream_lost(message[1], message[2])
        elif kind == "fatal":
            self.fatal(message[1])
        elif kind == "signal":
            self.on_signal(message[1])

    def on_event(self, event):
        data = event.json()
        if not isinstance(data, dict):
            return  # keep-alives and library notices without JSON data
        kind = data.get("type") or event.type
        logger.debug("event %s %s", kind, {k: v for k, v in data.items() if k not in ("config", "dataloader")})
        if kind == protocol.JOB_SUBMIT:
            self.on_job_submit(data)
        elif kind == protocol.JOB_CANCEL:
            self.on_job_cancel(data)
        elif kind == protocol.DRAIN:
            self.start_drain("the orchestrator asked this worker to drain")
        elif kind == protocol.SHUTDOWN:
            self.on_shutdown(data)
        elif kind == protocol.STREAM_RESET:
            logger.info("The orchestrator no longer has the events since the last one seen; state was reconciled at registration")
        # Anything else (protocol.PING, the upstream agent's keep-alive, or a type this agent does not know) is ignored.

    # --- drain, signals, exit -----------------------------------------------------------------

    def start_drain(self, why):
        if self.draining:
            return
        self.draining = True
        if self.current_job_id():
            logger.info("Draining (%s): finishing job %s, then taking no new job", why, self.current_job_id())
        else:
            self._idle_drained()

    def _idle_drained(self):
        if not self.config.persistent:
            self.leave("ephemeral worker drained")
        else:
            logger.info("Draining: this worker takes no new jobs; stop the agent when convenient")

    def on_signal(self, signum):
        self.signals += 1
        name = signal.Signals(signum).name
        job_id = self.current_job_id()
        if self.signals == 1:
            if job_id is None:
                self.leave(f"{name} received")
            else:
                logger.info("%s: finishing job %s, then exiting (send it again to stop the job now)", name, job_id)
        elif self.signals == 2 and self.job is not None:
            logger.info("%s again: stopping job %s now", name, job_id)
            self.job.stop(STOP_AGENT_EXIT)
        else:
            logger.warning("%s again: exiting now%s", name, f" without reporting job {job_id}" if job_id else "")
            if self.job is not None:
                self.job.kill()
            self.exit_code = 1

    def on_shutdown(self, data: protocol.ShutdownEvent):
        """The orchestrator ended this worker's stream for good: exit 1 with its reason.

        The fix shown is chosen by the event's ``code`` alone (SHUTDOWN_FIXES); without a known code
        there is none. The ``reason`` is for people and is never parsed.
        """
        reason = str(data.get("reason") or "no reason given")
        code = data.get("code")
        fix = SHUTDOWN_FIXES.get(code, "") if isinstance(code, str) else ""
        self.fatal(FatalError(f"the orchestrator closed this worker's stream: {reason}", fix=fix), disconnect=False)

    def leave(self, why):
        """Disconnect gracefully and exit 0 (the caller made sure no job runs)."""
        logger.info("Disconnecting (%s)", why)
        if self.ever_registered:
            try:
                self.client.disconnect()
            except AgentError as exc:
                logger.warning("Disconnect not acknowledged: %s", exc)
        self.exit_code = 0

    def fatal(self, exc, *, disconnect=False):
        """Report ``exc`` as one line and exit 1; a running job is stopped first (see _shut_down)."""
        if self.exit_code is not None:
            return
        logger.error("%s", exc)
        if disconnect and self.ever_registered:
            try:
                self.client.disconnect()
            except AgentError:
                pass
        self.exit_code = 1
