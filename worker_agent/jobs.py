"""The agent's job handling: take a dispatched job, acknowledge and start it, report progress and its result.

``JobsMixin`` holds no state of its own: its methods run on the agent's main thread over the state
``Agent.__init__`` declares (agent.py).

A dispatched job waits in ``pending_ack`` until its dispatch is acknowledged (docs/agent-guide.md,
"What it does"); only then does its trainer start. A finished job's result is journaled (journal.py) before it
is reported, and stays in ``pending_report`` until the orchestrator answers.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

from . import journal, protocol, supervisor
from . import progress as progress_protocol
from .artifacts import ArtifactTransfer, TransferError
from .client import FatalError, Refused, Rejected, TransientError
from .runner import STOP_ABANDON, STOP_AGENT_EXIT, STOP_CANCEL, describe_exit, exit_report

logger = logging.getLogger("worker_agent")

PROGRESS_REPORT_INTERVAL = 1.0  # at most one progress report a second
CONSOLE_PROGRESS_INTERVAL = 5.0
FINISHED_ATTEMPTS_KEPT = 100
# How long a dispatch may wait for its acknowledgement when the orchestrator does not say
# (``dispatch_ack_timeout`` in the register response); measured from the job_submit's arrival.
DEFAULT_DISPATCH_ACK_TIMEOUT = 60.0
ACK_RETRY_CAP = 10.0  # the acknowledgement's backoff cap: several tries fit in the deadline
RECEIVED_KEY = "_received"  # added to a job_submit kept in ``waiting``: when it arrived (agent clock)


@dataclass
class PendingAck:
    """A dispatched job whose trainer may start only once its dispatch is acknowledged.

    ``deadline`` (agent clock) is when it is given up without running; ``due`` is when ``starting``
    is sent again after a transient failure (None: no retry scheduled).
    """

    data: dict
    job_id: str
    attempt: str | None
    received: float
    deadline: float
    due: float | None = None


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
        """Return the job this agent holds: running, awaiting its acknowledgement, or awaiting its result's delivery."""
        if self.job is not None:
            return self.job.job_id
        if self.pending_ack is not None:
            return self.pending_ack.job_id
        if self.pending_report is not None:
            return self.pending_report[0]
        return None

    def current_attempt(self):
        """Return the attempt (lease id) of ``current_job_id()``, or None."""
        if self.job is not None:
            return self.job.attempt
        if self.pending_ack is not None:
            return self.pending_ack.attempt
        if self.pending_report is not None:
            return self.pending_report[1].get("attempt")
        return None

    def on_job_submit(self, data):
        job_id, attempt = data.get("job_id"), data.get("attempt")
        if not job_id:
            logger.warning("Ignoring a job_submit without job_id")
            return
        job_id = str(job_id)
        if self.job is not None and self.job.job_id == job_id and attempt in (None, self.job.attempt):
            return  # delivered again (replay or redelivery): already running it
        ack = self.pending_ack
        if ack is not None and ack.job_id == job_id:
            if attempt in (None, ack.attempt):
                return  # delivered again while its acknowledgement is under way
            # The orchestrator took the earlier dispatch back and dispatched the job anew: that one wins.
            logger.info(
                "Job %s dispatched again (attempt %s); the earlier dispatch (%s) is dropped", job_id, attempt, ack.attempt
            )
            self._drop_ack()
        if attempt and attempt in self.finished_attempts:
            return  # an old dispatch replayed after a reconnect
        if self.pending_report is not None and self.pending_report[0] == job_id and attempt == self.pending_report[1].get("attempt"):
            return
        if self.signals:
            logger.info("Job %s arrived while stopping; not started (the orchestrator requeues it at disconnect)", job_id)
            return
        if self.job is not None or self.pending_ack is not None or self.pending_report is not None:
            if all(w.get("attempt") != attempt or w.get("job_id") != job_id for w in self.waiting):
                self.waiting.append({**data, RECEIVED_KEY: self.clock()})
                logger.info("Job %s arrived while job %s is busy; it starts next", job_id, self.current_job_id())
            return
        self.start_job(data)

    # --- acknowledging a dispatch -------------------------------------------------------------

    def start_job(self, data):
        """Acknowledge the dispatch ``data`` (a job_submit); its trainer starts once that is accepted.

        Acknowledged by: ``starting`` answered 200; a heartbeat naming the job and attempt answered
        with the job as the worker's current one; a re-register naming them answered with
        ``resume_job``. Transient failures are retried with backoff until ``dispatch_ack_timeout``
        after arrival; then the job is given up without running. A refusal drops it.
        """
        job_id, attempt = str(data["job_id"]), data.get("attempt")
        received = data.get(RECEIVED_KEY, self.clock())
        self.pending_ack = PendingAck(
            data=data, job_id=job_id, attempt=attempt, received=received, deadline=received + self.dispatch_ack_timeout
        )
        self.ack_backoff.reset()
        self.send_acknowledgement()

    def send_acknowledgement(self):
        """Send ``starting`` for the pending dispatch; start it, drop it, or schedule a retry, by the answer."""
        ack = self.pending_ack
        ack.due = None
        acknowledgement: protocol.JobReport = {"status": protocol.STARTING, "attempt": ack.attempt}
        try:
            self.client.report(ack.job_id, acknowledgement)
        except Refused as exc:
            self._refused(ack.job_id, exc)  # dropped, not started (a cancelled one is reported cancelled)
            return
        except FatalError as exc:
            self.fatal(exc)
            return
        except Rejected as exc:
            logger.error("The orchestrator rejected the acknowledgement of job %s (%s); not started", ack.job_id, exc)
            self._drop_ack()
            self._after_job(reported=False)
            return
        except TransientError as exc:
            now = self.clock()
            delay = self.ack_backoff.next_delay(exc.retry_after or 0)
            ack.due = now + delay
            logger.warning(
                "Could not acknowledge job %s (%s); not started yet: retrying in %.0fs (gives up in %.0fs)",
                ack.job_id,
                exc.message,
                delay,
                max(ack.deadline - now, 0),
            )
            return
        self._acknowledged("its starting report was accepted")

    def check_acknowledgement(self):
        """Give the pending dispatch up past its deadline, or send ``starting`` again when due."""
        ack = self.pending_ack
        now = self.clock()
        if now >= ack.deadline:
            logger.warning(
                "Job %s not started: its dispatch (attempt %s) was not acknowledged within %.0fs; the orchestrator requeues it",
                ack.job_id,
                ack.attempt,
                self.dispatch_ack_timeout,
            )
            self._drop_ack()
            if self.registered:
                # Say so at once: a registration without the job releases anything the orchestrator
                # still holds for this worker (a `starting` applied whose answer was lost).
                self.register_due = now
            self._after_job(reported=False)
        elif ack.due is not None and now >= ack.due:
            self.send_acknowledgement()

    def _acknowledged(self, how):
        """The pending dispatch is acknowledged: start its trainer."""
        ack, self.pending_ack = self.pending_ack, None
        self.ack_backoff.reset()
        logger.debug("job %s acknowledged: %s", ack.job_id, how)
        self._launch(ack.data)

    def _drop_ack(self):
        """Forget the pending dispatch without running it (its attempt is remembered as over)."""
        if self.pending_ack is not None:
            self._remember_attempt(self.pending_ack.attempt)
        self.pending_ack = None
        self.ack_backoff.reset()

    # --- running a job ------------------------------------------------------------------------

    def _launch(self, data):
        job_id, attempt = str(data["job_id"]), data.get("attempt")
        label = data.get("config_name") or job_id
        transfer = None
        if data.get("upload_token") and data.get("upload_endpoint"):
            transfer = ArtifactTransfer(
                base_url=self.client.base_url, upload_endpoint=data["upload_endpoint"], token=data["upload_token"], verify=self.client.verify
            )
        run = self.run_factory(
            transfer=transfer,
            resume=data.get("resume") if transfer is not None else None,
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
        except (OSError, ValueError, TransferError) as exc:
            why = getattr(exc, "strerror", None) or str(exc)
            error = f"cannot start the training command {self.command[0]!r}: {why}"
            if isinstance(exc, TransferError):
                error = f"cannot fetch the checkpoint to resume from: {exc}"
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
        chunk = run.log_chunk()
        if chunk:
            body["log_lines"] = chunk  # the whole log, kept by the orchestrator, a run of new lines at a time
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
        run.log_sent(chunk)

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
        ack = self.pending_ack
        if ack is not None and ack.job_id == job_id and data.get("attempt") in (None, ack.attempt):
            logger.info("Job %s cancelled by the orchestrator before it started; not started", job_id)
            self._drop_ack()
            # Nothing ran: reported (not journaled) so that the orchestrator frees this worker at once.
            cancelled: protocol.JobReport = {
                "status": protocol.CANCELLED,
                "attempt": ack.attempt,
                "error": "cancelled before it started",
            }
            self._queue_report(job_id, cancelled, journal_it=False)
            return
        before = len(self.waiting)
        self.waiting = [w for w in self.waiting if str(w.get("job_id")) != job_id]
        if len(self.waiting) != before:
            logger.info("Job %s cancelled before it started", job_id)

    def abandon(self, job_id, reason):
        """The orchestrator says ``job_id`` is no longer ours: stop its trainer without reporting it, or drop
        its dispatch if not started yet; a result held for it is reported once more (the report decides)."""
        if self.job is not None and self.job.job_id == job_id:
            logger.warning("Abandoning job %s: %s", job_id, reason)
            self.job.stop(STOP_ABANDON)
        elif self.pending_ack is not None and self.pending_ack.job_id == job_id:
            logger.warning("Dropping job %s before it started: %s", job_id, reason)
            self._drop_ack()
            self._after_job(reported=False)
        elif self.pending_report is not None and self.pending_report[0] == job_id:
            # Only the report itself decides about a result: the orchestrator accepts the completion
            # of an attempt it took back while nothing else runs the job. Try it now.
            logger.info("Job %s is no longer this worker's (%s); reporting its result once more now", job_id, reason)
            self.report_due = self.clock()
            self.deliver_report()

    def on_job_exit(self, run):
        if run is not self.job:
            return
        self.job = None
        self._remember_attempt(run.attempt)
        took = _duration((run.finished_at or self.clock()) - (run.started_at or self.clock()))
        code = run.returncode
        body = exit_report(
            run.attempt, code, run.stop_reason, progress=run.snapshot()[0], log_tail=run.log_tail(), last_line=run.last_line()
        )
        if body is None:
            supervisor.settle(run.job_dir)
            if run.stop_reason == STOP_AGENT_EXIT:
                # Not reported as a result: disconnecting hands the job back to the queue and takes this
                # worker offline in one step, so the requeued job cannot be dispatched straight back here.
                logger.info("Job %s stopped after %s (worker shutting down)", run.job_id, took)
                self.leave("stopped by signal; the orchestrator requeues the job")
                return
            logger.info("Job %s stopped (%s); not reported", run.job_id, describe_exit(code))
            self._after_job(reported=False)
            return
        if body["status"] == protocol.COMPLETED and getattr(run, "upload_error", None):
            # The trainer finished but its outputs are not in the artifact store: not a completed job.
            body.update(status=protocol.FAILED, error=f"training finished but its outputs could not be uploaded: {run.upload_error}")
        chunk = run.log_chunk()
        if chunk:
            body["log_lines"] = chunk  # the output not yet sent goes with the result
        if body["status"] == protocol.CANCELLED:
            logger.info("Job %s cancelled after %s", run.job_id, took)
        elif body["status"] == protocol.COMPLETED:
            logger.info("Job %s completed in %s", run.job_id, took)
        else:
            logger.info("Job %s failed after %s: %s", run.job_id, took, body["error"])
        self._queue_report(run.job_id, body)  # journaled first: then the supervisor's record is settled

    # --- results: journaled, then reported until the orchestrator answers ------------------------

    def _queue_report(self, job_id, body, *, journal_it=True):
        """Hold ``body`` as ``job_id``'s result and report it; journal it to disk first unless told not to."""
        path = None
        if journal_it:
            job_dir = Path(self.config.work_dir) / job_id
            try:
                path = journal.write_outcome(job_dir, job_id, body)
            except OSError as exc:
                logger.warning("Could not write the result of job %s to disk (%s); it is held in memory only", job_id, exc)
            else:
                supervisor.settle(job_dir)  # the outcome supersedes the supervisor's record of the exit
        self.pending_report = (job_id, body)
        self.pending_journal = path
        self.report_backoff.reset()
        self.report_due = self.clock()
        self.deliver_report()

    def deliver_report(self):
        """Report the held result; retry a transient failure later, or (when stopping) exit keeping it on disk."""
        job_id, body = self.pending_report
        answer = self._send_result(job_id, body, self.pending_journal)
        if answer is None:
            return  # fatal
        if isinstance(answer, TransientError):
            if self.signals:
                self._exit_keeping_result(answer)
                return
            delay = self.report_backoff.next_delay(answer.retry_after or 0)
            logger.warning("Could not report job %s (%s); retrying in %.0fs", job_id, answer.message, delay)
            self.report_due = self.clock() + delay
            return
        self.pending_report = None
        self.pending_journal = None
        self.report_due = None
        self._after_job(reported=True)

    def _send_result(self, job_id, body, path, *, minimal=False):
        """Report a result; return True once the orchestrator answered (the journal is then marked
        delivered), the TransientError to retry after, or None after a fatal error.

        A result rejected as sent (4xx: e.g. an output the orchestrator cannot take) is sent once more
        in its minimal form (``protocol.minimal_report``: no log, no progress), which it always accepts.
        """
        try:
            self.client.report(job_id, body)
        except Refused as exc:
            logger.warning("The orchestrator refused the result of job %s: %s", job_id, exc.message)
        except FatalError as exc:
            self.fatal(exc)
            return None
        except TransientError as exc:
            return exc
        except Rejected as exc:
            if not minimal and body.get("status") in protocol.RESULT_STATUSES:
                logger.error(
                    "The orchestrator rejected the result of job %s (%s); reporting it again without its log and progress",
                    job_id,
                    exc,
                )
                return self._send_result(job_id, protocol.minimal_report(body), path, minimal=True)
            logger.error("The orchestrator rejected the result of job %s: %s", job_id, exc)
        if path is not None:
            journal.mark_delivered(path)
        return True

    def _exit_keeping_result(self, exc):
        """Stopping, and the result cannot be delivered now: exit 0 and leave it to the next start.

        No disconnect: the orchestrator keeps the job on this worker, so the result reported at the
        next start is applied as any other.
        """
        job_id = self.pending_report[0]
        if self.pending_journal is not None:
            where = f"kept in {self.pending_journal}; the agent reports it when it starts again"
        else:
            where = "it could not be written to disk and is lost"
        logger.warning("Exiting without delivering the result of job %s (%s): %s", job_id, exc.message, where)
        self.exit_code = 0

    def deliver_journaled(self):
        """Report the results journaled before this agent started, oldest first; return True once none is left.

        Called before registering: a registration that does not name the job would make the
        orchestrator take it back first. A transient failure schedules the next try (``register_due``).
        """
        while self.journaled:
            path, job_id, body = self.journaled[0]
            answer = self._send_result(job_id, {**body, "journal": True}, path)  # says it was read back from disk
            if answer is None:
                return False
            if isinstance(answer, TransientError):
                self._unreachable(answer)
                if self.exit_code is None:
                    delay = self.register_backoff.next_delay(answer.retry_after or 0)
                    logger.warning("Cannot report the kept result of job %s: %s; retrying in %.0fs", job_id, answer, delay)
                    self.register_due = self.clock() + delay
                return False
            self.journaled.pop(0)
            self._remember_attempt(body.get("attempt"))
            logger.info(
                "Reported the result of job %s (attempt %s: %s) kept from before this agent started",
                job_id,
                body.get("attempt"),
                body.get("status"),
            )
        return True

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
            self.start_job(self.waiting.pop(0))  # a refusal comes back here for the next one
        else:
            logger.info("Waiting for jobs")
