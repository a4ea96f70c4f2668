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
"""

import importlib.util
import logging
import queue
import signal
import socket
import threading
import time

import requests

from . import __version__
from . import progress as progress_protocol
from .backoff import Backoff
from .client import AgentError, FatalError, OrchestratorClient, Refused, Rejected, TransientError
from .gpu import GpuMonitor, describe
from .runner import JobRun, describe_exit, parse_command
from .sse import SSEParser

logger = logging.getLogger("worker_agent")

PROGRESS_REPORT_INTERVAL = 1.0  # at most one progress report a second
CONSOLE_PROGRESS_INTERVAL = 5.0
STABLE_STREAM_S = 30.0  # a stream that lived this long was healthy: reconnect at once
EPHEMERAL_GIVE_UP_S = 300.0  # an ephemeral agent stops retrying an unreachable orchestrator after this
FINISHED_ATTEMPTS_KEPT = 100


def _exit_code_field(code):
    """Return the exit code as a shell reports it (128+N for a signal)."""
    if code is None:
        return None
    return 128 - code if code < 0 else code


def _duration(seconds):
    seconds = int(seconds or 0)
    minutes, seconds = divmod(seconds, 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class StreamReader:
    """Holds the SSE stream on a daemon thread and posts what it reads to the agent's queue.

    It (re)opens the stream each time ``go()`` is called (after every successful register), resuming
    with the last event id it saw. It posts ``("sse", Event)``, ``("stream_lost", reason, seconds_open)``
    and ``("fatal", FatalError)``.
    """

    def __init__(self, client, post):
        self._client = client
        self._post = post
        self._go = threading.Event()
        self._stopped = threading.Event()
        self._response = None
        self._thread = None
        self.last_event_id = None
        self.connected = False

    def start(self):
        self._thread = threading.Thread(target=self._run, name="sse-stream", daemon=True)
        self._thread.start()
        return self

    def go(self):
        """Open the stream (again): the agent has just registered."""
        self._go.set()

    def stop(self):
        """Stop reading: wake the reader by shutting its socket down (closing it from here can block)."""
        self._stopped.set()
        self._go.set()
        response = self._response
        sock = socket_of(response) if response is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _run(self):
        while True:
            self._go.wait()
            if self._stopped.is_set():
                return
            self._go.clear()
            try:
                response = self._client.open_stream(last_event_id=self.last_event_id)
            except FatalError as exc:
                self._post(("fatal", exc))
                return
            except AgentError as exc:
                self._post(("stream_lost", str(exc), 0.0))
                continue
            self._response = response
            opened = time.monotonic()
            self.connected = True
            reason = "closed by the orchestrator"
            parser = SSEParser()
            try:
                for chunk in response.iter_content(chunk_size=None):
                    for event in parser.feed(chunk):
                        if event.id:
                            self.last_event_id = event.id
                        self._post(("sse", event))
                    if self._stopped.is_set():
                        return
            except (requests.exceptions.RequestException, OSError, ValueError, AttributeError) as exc:
                reason = f"connection lost ({exc.__class__.__name__})"
            finally:
                self.connected = False
                self._response = None
                response.close()
            if self._stopped.is_set():
                return
            self._post(("stream_lost", reason, time.monotonic() - opened))


def socket_of(response):
    """Return the socket under a streamed response, or None (urllib3 2.x internals, best effort)."""
    raw = getattr(response, "raw", None)
    connection = getattr(raw, "_connection", None) or getattr(raw, "connection", None)
    sock = getattr(connection, "sock", None)
    if sock is not None:
        return sock
    try:
        return raw._fp.fp.raw._sock
    except AttributeError:
        return None


class Agent:
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
            self.job.stop("shutdown", grace=grace)
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
        if kind == "job_submit":
            self.on_job_submit(data)
        elif kind == "job_cancel":
            self.on_job_cancel(data)
        elif kind == "drain":
            self.start_drain("the orchestrator asked this worker to drain")
        elif kind == "shutdown":
            self.on_shutdown(str(data.get("reason") or "no reason given"))
        elif kind == "stream-reset":
            logger.info("The orchestrator no longer has the events since the last one seen; state was reconciled at registration")

    # --- registration and liveness ------------------------------------------------------------

    def current_job_id(self):
        if self.job is not None:
            return self.job.job_id
        if self.pending_report is not None:
            return self.pending_report[0]
        return None

    def register(self):
        body = {
            "name": self.config.name,
            "persistent": self.config.persistent,
            "current_job_id": self.current_job_id(),
            "hostname": socket.gethostname(),
            "agent_version": __version__,
            **self.capabilities,
        }
        try:
            result = self.client.register(body)
        except FatalError as exc:
            self.fatal(exc)
            return
        except Rejected as exc:
            self.fatal(FatalError(f"registration refused: {exc}"))
            return
        except (TransientError, Refused) as exc:
            self._unreachable(exc)
            if self.exit_code is None:
                delay = self.register_backoff.next_delay(getattr(exc, "retry_after", 0) or 0)
                logger.warning("Cannot register: %s; retrying in %.0fs", exc, delay)
                self.register_due = self.clock() + delay
            return
        self.register_backoff.reset()
        self.unreachable_since = None
        self.registered = True
        self.register_due = None
        first = not self.ever_registered
        self.ever_registered = True
        self.worker_id = result.get("worker_id")
        if self.config.heartbeat_interval is None and result.get("heartbeat_interval"):
            self.heartbeat_interval = float(result["heartbeat_interval"])
        logger.info(
            "%s as %s (%s) at %s",
            "Registered" if first else "Registered again",
            self.config.name,
            self.worker_id,
            self.config.orchestrator_url,
        )
        self._reconcile(result)
        self.next_heartbeat = self.clock() + self.heartbeat_interval
        self.stream.go()
        if result.get("draining"):
            self.start_drain("this worker is draining")
        elif self.job is None and self.pending_report is None and first:
            logger.info("Waiting for jobs")

    def _reconcile(self, result):
        resume = result.get("resume_job")
        abandon = result.get("abandon_job")
        if isinstance(resume, dict) and resume.get("job_id") == self.current_job_id():
            if self.job is not None:
                if resume.get("attempt"):
                    self.job.attempt = resume["attempt"]
                logger.info("The orchestrator confirmed job %s is still ours; it keeps running", self.job.job_id)
            if self.pending_report is not None:
                if resume.get("attempt"):
                    self.pending_report[1]["attempt"] = resume["attempt"]
                self.report_due = self.clock()
        elif abandon:
            self.abandon(str(abandon), "the orchestrator says it is no longer this worker's job")

    def heartbeat(self):
        body = {"status": "busy" if self.current_job_id() else "idle", "current_job_id": self.current_job_id()}
        if self.job is not None:
            body["progress"] = self.job.snapshot()[0] or None
        body.update(self.monitor.sample())
        self.next_heartbeat = self.clock() + self.heartbeat_interval
        try:
            result = self.client.heartbeat(body)
        except Refused as exc:
            if exc.abandon_job:
                self._refused(str(exc.abandon_job), exc)
            return
        except FatalError as exc:
            self.fatal(exc)
            return
        except (TransientError, Rejected) as exc:
            if not self.heartbeat_failing:
                logger.warning("Heartbeat failed: %s", exc)
            self.heartbeat_failing = True
            self._unreachable(exc)
            return
        if self.heartbeat_failing:
            logger.info("Heartbeats reach the orchestrator again")
        self.heartbeat_failing = False
        self.unreachable_since = None
        if result.get("draining"):
            self.start_drain("this worker is draining")

    def _unreachable(self, exc):
        """Count an unreachable orchestrator; an ephemeral agent gives up after EPHEMERAL_GIVE_UP_S."""
        now = self.clock()
        if self.unreachable_since is None:
            self.unreachable_since = now
        if not self.config.persistent and now - self.unreachable_since >= EPHEMERAL_GIVE_UP_S:
            self.fatal(FatalError(f"gave up after {int(now - self.unreachable_since)}s without the orchestrator: {exc.message}", fix=exc.fix))

    def on_stream_lost(self, reason, seconds_open):
        if self.exit_code is not None:
            return
        self.registered = False
        delay = 0.0 if seconds_open >= STABLE_STREAM_S else self.register_backoff.next_delay()
        if seconds_open >= STABLE_STREAM_S:
            self.register_backoff.reset()
        logger.warning("Stream to the orchestrator lost (%s); reconnecting in %.0fs", reason, delay)
        self.register_due = self.clock() + delay

    # --- jobs ---------------------------------------------------------------------------------

    def on_job_submit(self, data):
        job_id, attempt = data.get("job_id"), data.get("attempt")
        if not job_id:
            logger.warning("Ignoring a job_submit without job_id")
            return
        job_id = str(job_id)
        if self.job is not None and self.job.job_id == job_id and attempt in (None, self.job.attempt):
            return  # delivered again (replay or redelivery): already running it
        if attempt and attempt in self.finished_attempts:
            return  # an old dispatch replayed after a reconnect
        if self.pending_report is not None and self.pending_report[0] == job_id and attempt == self.pending_report[1].get("attempt"):
            return
        if self.signals:
            logger.info("Job %s arrived while stopping; not started (the orchestrator requeues it at disconnect)", job_id)
            return
        if self.job is not None or self.pending_report is not None:
            if all(w.get("attempt") != attempt or w.get("job_id") != job_id for w in self.waiting):
                self.waiting.append(data)
                logger.info("Job %s arrived while job %s is busy; it starts next", job_id, self.current_job_id())
            return
        self.start_job(data)

    def start_job(self, data):
        job_id, attempt = str(data["job_id"]), data.get("attempt")
        label = data.get("config_name") or job_id
        try:
            self.client.report(job_id, {"status": "starting", "attempt": attempt})
        except Refused as exc:
            logger.info("Job %s (%s) is no longer this worker's (%s); not started", job_id, label, exc.message)
            self._remember_attempt(attempt)
            return
        except FatalError as exc:
            self.fatal(exc)
            return
        except (TransientError, Rejected) as exc:
            logger.warning("Could not acknowledge job %s (%s); starting it anyway", job_id, exc)
        run = self.run_factory(
            job_id=job_id,
            attempt=attempt,
            config=data.get("config") or {},
            dataloader=data.get("dataloader"),
            work_dir=self.config.work_dir,
            command=self.command,
            on_exit=lambda finished: self.inbox.put(("job_exited", finished)),
            grace=self.config.cancel_grace,
            clock=self.clock,
        )
        try:
            run.start()
        except (OSError, ValueError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            error = f"cannot start the training command {self.command[0]!r}: {why}"
            logger.error("Job %s failed to start: %s", job_id, error)
            self._remember_attempt(attempt)
            self._queue_report(job_id, {"status": "failed", "attempt": attempt, "error": error})
            return
        self.job = run
        self.last_progress_report = None
        self.reported_version = -1
        self.console_version = -1
        self.last_console = None  # the first progress line shows at once, then one every few seconds
        number = data.get("attempt_number")
        logger.info(
            "Job %s started: %s%s, in %s", job_id, label, f" (attempt {number})" if number else "", run.job_dir
        )
        self.report_progress(force=True)

    def report_progress(self, *, force=False):
        run = self.job
        now = self.clock()
        progress, version = run.snapshot()
        if not force:
            if version == self.reported_version:
                return
            if self.last_progress_report is not None and now - self.last_progress_report < PROGRESS_REPORT_INTERVAL:
                return
        self.last_progress_report = now
        body = {"status": "running", "attempt": run.attempt, "progress": progress or None, "log_tail": run.log_tail()}
        try:
            self.client.report(run.job_id, body)
        except Refused as exc:
            self._refused(run.job_id, exc)
            return
        except FatalError as exc:
            self.fatal(exc)
            return
        except (TransientError, Rejected) as exc:
            logger.debug("progress report for job %s failed: %s", run.job_id, exc)
            return
        self.reported_version = version

    def _console_progress(self):
        run = self.job
        progress, version = run.snapshot()
        now = self.clock()
        if not progress or version == self.console_version:
            return
        if self.last_console is not None and now - self.last_console < CONSOLE_PROGRESS_INTERVAL:
            return
        self.console_version = version
        self.last_console = now
        logger.info("Job %s: %s", run.job_id, progress_protocol.format_progress(progress))

    def _refused(self, job_id, exc):
        """A report or heartbeat about ``job_id`` was refused (409): cancel it or abandon it."""
        if exc.code == "job_cancelled":
            self.on_job_cancel({"job_id": job_id})  # stopped and reported cancelled: frees the worker at once
        else:
            self.abandon(job_id, exc.message)

    def on_job_cancel(self, data):
        job_id = str(data.get("job_id") or "")
        if self.job is not None and self.job.job_id == job_id:
            if self.job.stop_reason is None:
                logger.info("Job %s cancelled by the orchestrator; stopping it", job_id)
                self.job.stop("cancel")
            return
        before = len(self.waiting)
        self.waiting = [w for w in self.waiting if str(w.get("job_id")) != job_id]
        if len(self.waiting) != before:
            logger.info("Job %s cancelled before it started", job_id)

    def abandon(self, job_id, reason):
        """Stop ``job_id`` without reporting it: the orchestrator says it is no longer ours."""
        if self.job is not None and self.job.job_id == job_id:
            logger.warning("Abandoning job %s: %s", job_id, reason)
            self.job.stop("abandon")
        elif self.pending_report is not None and self.pending_report[0] == job_id:
            logger.warning("Dropping the result of job %s: %s", job_id, reason)
            self.pending_report = None
            self.report_due = None
            self._after_job(reported=False)

    def on_job_exit(self, run):
        if run is not self.job:
            return
        self.job = None
        self._remember_attempt(run.attempt)
        took = _duration((run.finished_at or self.clock()) - (run.started_at or self.clock()))
        code = run.returncode
        if run.stop_reason == "abandon":
            logger.info("Job %s stopped (%s); not reported", run.job_id, describe_exit(code))
            self._after_job(reported=False)
            return
        body = {
            "attempt": run.attempt,
            "exit_code": _exit_code_field(code),
            "progress": run.snapshot()[0] or None,
            "log_tail": run.log_tail(),
        }
        if run.stop_reason == "cancel":
            body.update(status="cancelled", error="cancelled by the orchestrator")
            logger.info("Job %s cancelled after %s", run.job_id, took)
        elif run.stop_reason == "shutdown":
            # Not reported as a result: disconnecting hands the job back to the queue and takes this
            # worker offline in one step, so the requeued job cannot be dispatched straight back here.
            logger.info("Job %s stopped after %s (worker shutting down)", run.job_id, took)
            self.leave("stopped by signal; the orchestrator requeues the job")
            return
        elif code == 0:
            body.update(status="completed", error=None)
            logger.info("Job %s completed in %s", run.job_id, took)
        else:
            error = f"Training {describe_exit(code)}"
            last = run.last_line()
            if last:
                error += f": {last}"
            body.update(status="failed", error=error)
            logger.info("Job %s failed after %s: %s", run.job_id, took, error)
        self._queue_report(run.job_id, body)

    def _queue_report(self, job_id, body):
        self.pending_report = (job_id, body)
        self.report_backoff.reset()
        self.report_due = self.clock()
        self.deliver_report()

    def deliver_report(self):
        job_id, body = self.pending_report
        try:
            self.client.report(job_id, body)
        except Refused as exc:
            logger.warning("The orchestrator refused the result of job %s: %s", job_id, exc.message)
        except FatalError as exc:
            self.fatal(exc)
            return
        except TransientError as exc:
            delay = self.report_backoff.next_delay(exc.retry_after or 0)
            logger.warning("Could not report job %s (%s); retrying in %.0fs", job_id, exc.message, delay)
            self.report_due = self.clock() + delay
            return
        except Rejected as exc:
            logger.error("The orchestrator rejected the result of job %s: %s", job_id, exc)
        self.pending_report = None
        self.report_due = None
        self._after_job(reported=True)

    def _remember_attempt(self, attempt):
        if attempt:
            self.finished_attempts.append(attempt)
            del self.finished_attempts[:-FINISHED_ATTEMPTS_KEPT]

    def _after_job(self, *, reported):
        if reported:
            self.jobs_reported += 1
        if self.signals:
            self.leave("stopping after the signal")
        elif reported and not self.config.persistent:
            self.leave("ephemeral worker: its job is done")
        elif self.draining:
            self._idle_drained()
        elif self.waiting:
            self.start_job(self.waiting.pop(0))
        else:
            logger.info("Waiting for jobs")

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
            self.job.stop("shutdown")
        else:
            logger.warning("%s again: exiting now%s", name, f" without reporting job {job_id}" if job_id else "")
            if self.job is not None:
                self.job.kill()
            self.exit_code = 1

    def on_shutdown(self, reason):
        revoked = any(word in reason for word in ("token", "deleted", "revoked"))
        fix = (
            "request a new token (admin → Workers → rotate token) and restart the agent with it" if revoked else ""
        )
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

