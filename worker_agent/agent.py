"""The agent's main loop: register, hold the stream, heartbeat, run jobs, report, reconnect.

All state lives on the main thread. The stream reader, the job's waiter and the signal handlers only
post messages to its queue, so every decision (start, stop, report, exit) is taken in one place.

Rules (docs/agent-guide.md):
- A dispatch's trainer starts only once the dispatch is acknowledged: ``starting`` answered 200, a
  heartbeat naming the job and attempt answered with the job as this worker's, or a re-register naming
  them answered with ``resume_job``. Transient failures are retried with backoff (the loop goes on)
  until ``dispatch_ack_timeout`` (register response; 60 s by default) after the job_submit arrived;
  then the job is given up without running and nothing is reported. A refusal (409) drops it, so a
  replayed or stale dispatch never runs. ``running`` follows once the process is up, then progress
  (at most once a second), then exactly one terminal report, retried until the orchestrator answers.
- A result is written to ``<job dir>/outcome.json`` (journal.py) before it is reported, and renamed
  ``outcome.reported.json`` once the orchestrator answered. At start-up, and before every
  re-registration, results not delivered yet are reported first (with their attempt).
- A 409 on any report or heartbeat naming our job means it is no longer ours: the process is stopped
  and nothing more is reported for it (``abandon``).
- After the stream drops, the agent registers again, reporting the job it runs (``resume_job`` keeps
  it, ``abandon_job`` stops it), then reopens the stream with Last-Event-ID.
- First SIGTERM/SIGINT: take no new job, let the running trainer finish and report it, disconnect,
  exit 0. Without a running trainer the agent leaves within seconds: a dispatch awaiting its
  acknowledgement is given up (not started; disconnecting hands it back); a result not delivered yet
  gets one more try, and otherwise stays in its journal for the next start (exit 0, no disconnect).
  A call blocked on an unresponsive orchestrator is interrupted (a registration in flight is let
  finish within its timeout: the disconnect needs its answer), and calls made while stopping use
  short timeouts. Second: stop the job now and disconnect (the orchestrator requeues the job by its
  retry rules and takes the worker offline in the same step), exit 0. Third: kill the job and exit at
  once (status 1).
- Ephemeral: exit 0 after one job is reported, or when drained while idle. Persistent: stay.
- Several jobs at once only when the register answer's ``max_jobs`` > 1 (the agent registers with
  ``max_jobs`` when it has two GPU slots or more): each job_submit then starts at once on its
  ``gpu_indices``, and every rule above applies to each job on its own (its acknowledgement, its
  result and journal, cancel, abandon, a 409). Heartbeats carry ``jobs``; a job the answer's ``jobs``
  no longer holds is abandoned. Drain and signals apply to every job: the agent leaves once the last
  one has ended.

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
import uuid

from . import __version__, journal, protocol
from .backoff import Backoff
from .client import AgentError, FatalError, Interrupted, OrchestratorClient
from .gpu import GpuMonitor, describe
from .jobs import DEFAULT_DISPATCH_ACK_TIMEOUT, PROGRESS_REPORT_INTERVAL, JobsMixin
from .runner import STOP_AGENT_EXIT, JobRun, parse_command
from .session import REPLACED_FIX, SessionMixin, StreamReader

logger = logging.getLogger("worker_agent")

# What to do after the orchestrator ended this worker's stream for good, by the shutdown event's ``code``.
SHUTDOWN_FIXES = {
    protocol.TOKEN_REVOKED: "request a new token (admin → Workers → rotate token) and restart the agent with it",
    protocol.WORKER_DELETED: (
        "this worker was deleted: create a new one (admin → Workers) and start the agent with its token"
    ),
    protocol.AGENT_REPLACED: REPLACED_FIX,
}


class Agent(SessionMixin, JobsMixin):
    """One worker agent process. ``run()`` returns the exit status.

    ``client``, ``monitor``, ``clock``, ``run_factory`` and ``stream`` are injectable for tests.
    """

    def __init__(self, config, *, client=None, monitor=None, clock=time.monotonic, run_factory=JobRun, stream=None):
        self.config = config
        # This process's own instance, on every request: the orchestrator tells our reconnects from another agent's.
        self.instance = uuid.uuid4().hex
        if client is None:
            client = OrchestratorClient(config.orchestrator_url, config.token, verify=config.verify)
            client.session.headers[protocol.AGENT_INSTANCE_HEADER] = self.instance
        self.client = client
        self.monitor = monitor or GpuMonitor()
        self.clock = clock
        self.run_factory = run_factory
        self.command = parse_command(config.command)
        self.inbox = queue.SimpleQueue()  # put() is reentrant: the signal handler posts to it
        self.stream = stream or StreamReader(self.client, self.inbox.put)
        self.register_backoff = Backoff()
        self.heartbeat_interval = config.heartbeat_interval or 30.0
        self.dispatch_ack_timeout = DEFAULT_DISPATCH_ACK_TIMEOUT  # the register response's, once registered
        self.capabilities = {}
        self.gpu_slots = []  # the GPU indices jobs may be given (monitor.slots())
        self.gpu_slots_declared = False
        self.max_jobs = 1  # jobs at once: the register answer's max_jobs (1 unless the orchestrator packs)
        self.worker_id = None
        self.registered = False
        self.ever_registered = False
        self.register_due = None
        self.next_heartbeat = None
        self.heartbeat_failing = False
        self.unreachable_since = None
        self.slots = {}  # job id -> jobs.JobSlot: every job held, from its dispatch until its result is delivered
        # [(journal.Journaled, legacy)]: results found on disk, not delivered yet (legacy: an older agent's, un-keyed)
        self.journaled = []
        self.jobs_dir = None  # <work dir>/<worker id>: this worker's job dirs, once its id is known
        self.waiting = []  # job_submit payloads that arrived while busy
        self.finished_attempts = []
        self.draining = False
        self.signals = 0  # signals handled by the main loop
        self.signals_caught = 0  # signals received by the handler (counted before the loop sees them)
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
                try:
                    self.tick()
                    if self.exit_code is not None:
                        break
                    try:
                        message = self.inbox.get(timeout=self._wait_time())
                    except queue.Empty:
                        continue
                    self.handle(message)
                except Interrupted:
                    continue  # a signal broke a call just as it ended; the signal's message is queued
        finally:
            self._shut_down()
        return self.exit_code

    def _start_up(self):
        mode = "persistent" if self.config.persistent else "ephemeral (exits after one job)"
        logger.info("SimpleTuner worker agent %s: %s, %s", __version__, self.config.name, mode)
        if self.config.gpus is not None:
            try:
                self.monitor.use_gpus(self.config.gpus)
            except ValueError as exc:
                self.fatal(FatalError(str(exc), fix="pass --gpus (or SIMPLETUNER_WORKER_GPUS) with indices NVML sees, or leave it out"))
                return
        self.capabilities = self.monitor.capabilities()
        self.gpu_slots, self.gpu_slots_declared = self.monitor.slots()
        logger.info("Accelerators: %s", describe(self.capabilities))
        if self.gpu_slots_declared:
            logger.info("GPU slots declared by --gpus (no NVIDIA GPU backs them): %s", ",".join(map(str, self.gpu_slots)))
        elif self.config.gpus is not None:
            logger.info("Using GPU %s (--gpus)", ",".join(map(str, self.gpu_slots)))
        if self.config.command is None and importlib.util.find_spec("simpletuner") is None:
            logger.warning(
                "SimpleTuner is not installed in this Python (%s), so jobs will fail with the default "
                "training command. Install simpletuner here, or pass --command / SIMPLETUNER_WORKER_COMMAND.",
                self.command[0],
            )
        logger.info("Training command: %s", " ".join(self.command))
        self._find_journal()
        logger.info("Connecting to %s", self.config.orchestrator_url)
        self.register_due = self.clock()

    def _find_journal(self):
        """Find the results from before this start not delivered yet: this worker's (known by its token from an
        earlier start in this work dir) and an older agent's un-keyed ones; they are reported before registering."""
        work_dir = self.config.work_dir
        known = journal.worker_of_token(work_dir, self.config.token)
        if known is not None and not self._use_jobs_dir(known):
            return
        journal.recover_exits(work_dir)  # trainers that ended while no agent watched (an older agent's)
        self.journaled = [(entry, True) for entry in journal.undelivered(work_dir, worker_id=known)]
        if known is not None:
            journal.recover_exits(self.jobs_dir, worker_id=known)
            self.journaled = [(entry, False) for entry in journal.undelivered(self.jobs_dir, worker_id=known)] + self.journaled
        logger.info("Job directories: %s", self.jobs_dir or f"{work_dir}/<worker id> (known once registered)")
        self._announce_journaled("before registering")

    def _use_jobs_dir(self, worker_id):
        """Keep this worker's job dirs in ``<work dir>/<worker_id>``, remembering this token as the worker's; return
        False (having exited 1) if that directory cannot be used."""
        try:
            self.jobs_dir = journal.remember_worker(self.config.work_dir, worker_id, self.config.token)
        except (OSError, ValueError) as exc:
            self.fatal(FatalError(f"cannot use the job directory of worker {worker_id} in {self.config.work_dir}: {exc}"))
            return False
        return True

    def _announce_journaled(self, when):
        if self.journaled:
            logger.info(
                "%d job result(s) from before this start not delivered yet (%s): reporting them %s",
                len(self.journaled),
                ", ".join(entry.job_id for entry, _ in self.journaled),
                when,
            )


    def _shut_down(self):
        grace = min(self.config.cancel_grace, 10.0)
        running = [slot.run for slot in self.running_slots() if slot.run.running]
        for run in running:
            run.stop(STOP_AGENT_EXIT, grace=grace)
        for run in running:
            run.wait(grace + 5)
        self.stream.stop()
        self.monitor.close()
        self.client.close()

    def _install_signal_handlers(self):
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.on_os_signal)

    def on_os_signal(self, signum, frame=None):
        """The signal handler (main thread): post the signal to the loop; break a blocked call when the
        signal changes what the agent does next.

        The first signal without a trainer running starts the goodbye (a blocked stream read or a call to
        an unresponsive orchestrator must not delay it); the second stops a running trainer now; the third
        exits at once. A second signal without a trainer leaves the goodbye alone: its calls are bounded by
        STOPPING_TIMEOUT, and cutting the disconnect short would leave the worker online until its
        heartbeat timeout (a supervisor that sends two signals in a row, as ``simpletuner server`` does,
        would lose every goodbye that takes longer than its gap)."""
        self.inbox.put(("signal", signum))
        self.signals_caught += 1
        caught, running = self.signals_caught, bool(self.running_slots())
        if caught >= 3 or (caught == 1 and not running) or (caught == 2 and running):
            # Raises Interrupted into the call the main thread is blocked in, if any; a registration in flight
            # is left to finish (the goodbye needs its answer) unless the agent exits now.
            self.client.interrupt(force=caught >= 3)

    def _wait_time(self):
        now = self.clock()
        due = [t for t in (self.register_due, self.next_heartbeat, self.report_due) if t is not None]
        for slot in self.slots.values():
            if slot.ack is not None:
                due.append(slot.ack.deadline)
                if slot.ack.due is not None:
                    due.append(slot.ack.due)
            if slot.run is not None:
                due.append((slot.last_progress_report or now) + PROGRESS_REPORT_INTERVAL)
        if not due:
            return 1.0
        return min(max(min(due) - now, 0.01), 1.0)

    # --- timers -------------------------------------------------------------------------------

    def tick(self):
        """Do whatever is due: register, heartbeat, progress, a pending result."""
        now = self.clock()
        if self.register_due is not None and now >= self.register_due and self._delivered_before_registering():
            self.register()
        if self.exit_code is None and self.pending_ack is not None:
            self.check_acknowledgements()
        if self.exit_code is None and self.next_heartbeat is not None and now >= self.next_heartbeat:
            self.heartbeat()
        for slot in self.report_slots():
            if self._holds(slot) and slot.report is not None and slot.report_due is not None and now >= slot.report_due:
                self.deliver_report(slot)
        for slot in self.running_slots():
            if self._holds(slot) and slot.run is not None and slot.run.running:
                self.report_progress(slot)
                if self._holds(slot) and slot.run is not None:
                    self._console_progress(slot)

    def _delivered_before_registering(self):
        """Report what must reach the orchestrator before this worker registers; return True when it has.

        A registration that does not name a job makes the orchestrator take that job back; a result
        reported first is applied (or refused) as it is. Journaled results from before this start go
        first, then a result held in memory (after a dropped stream).
        """
        if self.journaled and not self.deliver_journaled():
            return False
        for slot in self.report_slots():
            if self._holds(slot) and (slot.report_due is None or slot.report_due <= self.clock()):
                self.deliver_report(slot)
        if self.report_slots() and self.exit_code is None:
            self.register_due = self.report_due  # registers once they are delivered
            return False
        return self.exit_code is None and self.register_due is not None

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
            self.start_drain("the orchestrator asked this worker to drain")  # job_ids: the jobs it lets finish
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
        if self.slots:
            logger.info("Draining (%s): finishing job %s, then taking no new job", why, ", ".join(self.slots))
        else:
            self._idle_drained()

    def end_drain(self):
        """The orchestrator put this worker back in service (an operator undrained it): take jobs again."""
        self.draining = False
        logger.info("Back in service: this worker takes jobs again")

    def _idle_drained(self):
        if not self.config.persistent:
            self.leave("ephemeral worker drained")
        else:
            logger.info("Draining: this worker takes no new jobs; stop the agent when convenient")

    def on_signal(self, signum):
        self.signals += 1
        self.client.stopping()
        name = signal.Signals(signum).name
        running = self.running_slots()
        jobs = ", ".join(slot.job_id for slot in running)
        if self.signals == 1:
            for slot in [slot for slot in self.slots.values() if slot.ack is not None]:
                logger.info(
                    "%s: job %s not started (its dispatch was not acknowledged yet); disconnecting hands it back", name, slot.job_id
                )
                self._drop_ack(slot)
            if running:
                logger.info("%s: finishing job %s, then exiting (send it again to stop the job now)", name, jobs)
            for slot in self.report_slots():
                if not self._holds(slot):
                    break
                logger.info("%s: reporting the result of job %s once more, then exiting", name, slot.job_id)
                self.deliver_report(slot)  # delivered: leaves once no job is left; not: exits keeping it in its journal
            if self.exit_code is None and not self.slots:
                self.leave(f"{name} received")
        elif self.signals == 2 and running:
            logger.info("%s again: stopping job %s now", name, jobs)
            for slot in running:
                slot.run.stop(STOP_AGENT_EXIT)
        elif self.signals == 2:
            logger.info("%s again: no job runs; leaving as soon as the orchestrator has heard (a third exits now)", name)
        else:
            job_ids = ", ".join(self.slots)
            logger.warning("%s again: exiting now%s", name, f" without reporting job {job_ids}" if job_ids else "")
            for slot in running:
                slot.run.kill()
            self.exit_code = 1

    def on_shutdown(self, data: protocol.ShutdownEvent):
        """The orchestrator ended this worker's stream for good: exit 1 with its reason.

        The fix shown is chosen by the event's ``code`` alone (SHUTDOWN_FIXES); without a known code
        there is none. The ``reason`` is for people and is never parsed.
        """
        reason = str(data.get("reason") or "no reason given")
        code = data.get("code")
        fix = SHUTDOWN_FIXES.get(code, "") if isinstance(code, str) else ""
        if code == protocol.AGENT_REPLACED:
            # Not disconnecting: the worker is the other agent's now.
            who = f"{data.get('agent_name') or 'an agent'} on {data.get('agent_host') or 'an unknown host'}"
            message = f"another agent took this worker over with the same token ({who}); this agent stops"
            self.fatal(FatalError(message, fix=fix), disconnect=False)
            return
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
