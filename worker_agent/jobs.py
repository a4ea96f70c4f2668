"""The agent's job handling: take a dispatched job, acknowledge and start it, report progress and its result.

``JobsMixin`` holds no state of its own: its methods run on the agent's main thread over the state
``Agent.__init__`` declares (agent.py).
"""

import logging

from . import protocol
from . import progress as progress_protocol
from .client import FatalError, Refused, Rejected, TransientError
from .runner import STOP_ABANDON, STOP_AGENT_EXIT, STOP_CANCEL, describe_exit

logger = logging.getLogger("worker_agent")

PROGRESS_REPORT_INTERVAL = 1.0  # at most one progress report a second
CONSOLE_PROGRESS_INTERVAL = 5.0
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


class JobsMixin:
    """One job at a time: submit, acknowledge, start, progress, the result (retried until delivered), cancel, abandon."""

    def current_job_id(self):
        if self.job is not None:
            return self.job.job_id
        if self.pending_report is not None:
            return self.pending_report[0]
        return None

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
            acknowledgement: protocol.JobReport = {"status": protocol.STARTING, "attempt": attempt}
            self.client.report(job_id, acknowledgement)
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
            failure: protocol.JobReport = {"status": protocol.FAILED, "attempt": attempt, "error": error}
            self._queue_report(job_id, failure)
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
        body: protocol.JobReport = {
            "status": protocol.RUNNING,
            "attempt": run.attempt,
            "progress": progress or None,
            "log_tail": run.log_tail(),
        }
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
        """A report or heartbeat about ``job_id`` was refused (409): cancel or abandon it, by the refusal's code."""
        if exc.code == protocol.JOB_CANCELLED:
            self.on_job_cancel({"job_id": job_id})  # stopped and reported cancelled: frees the worker at once
        else:
            self.abandon(job_id, exc.message)

    def on_job_cancel(self, data):
        job_id = str(data.get("job_id") or "")
        if self.job is not None and self.job.job_id == job_id:
            if self.job.stop_reason is None:
                logger.info("Job %s cancelled by the orchestrator; stopping it", job_id)
                self.job.stop(STOP_CANCEL)
            return
        before = len(self.waiting)
        self.waiting = [w for w in self.waiting if str(w.get("job_id")) != job_id]
        if len(self.waiting) != before:
            logger.info("Job %s cancelled before it started", job_id)

    def abandon(self, job_id, reason):
        """Stop ``job_id`` without reporting it: the orchestrator says it is no longer ours."""
        if self.job is not None and self.job.job_id == job_id:
            logger.warning("Abandoning job %s: %s", job_id, reason)
            self.job.stop(STOP_ABANDON)
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
        if run.stop_reason == STOP_ABANDON:
            logger.info("Job %s stopped (%s); not reported", run.job_id, describe_exit(code))
            self._after_job(reported=False)
            return
        body: protocol.JobReport = {
            "attempt": run.attempt,
            "exit_code": _exit_code_field(code),
            "progress": run.snapshot()[0] or None,
            "log_tail": run.log_tail(),
        }
        if run.stop_reason == STOP_CANCEL:
            body.update(status=protocol.CANCELLED, error="cancelled by the orchestrator")
            logger.info("Job %s cancelled after %s", run.job_id, took)
        elif run.stop_reason == STOP_AGENT_EXIT:
            # Not reported as a result: disconnecting hands the job back to the queue and takes this
            # worker offline in one step, so the requeued job cannot be dispatched straight back here.
            logger.info("Job %s stopped after %s (worker shutting down)", run.job_id, took)
            self.leave("stopped by signal; the orchestrator requeues the job")
            return
        elif code == 0:
            body.update(status=protocol.COMPLETED, error=None)
            logger.info("Job %s completed in %s", run.job_id, took)
        else:
            error = f"Training {describe_exit(code)}"
            last = run.last_line()
            if last:
                error += f": {last}"
            body.update(status=protocol.FAILED, error=error)
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
