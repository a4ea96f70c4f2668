"""The agent's job handling: take a dispatched job, acknowledge and start it, report progress and its result.

``JobsMixin`` holds no state of its own: its methods run on the agent's main thread over the state
``Agent.__init__`` declares (agent.py).

Each job the agent holds has a ``JobSlot`` in ``Agent.slots`` from its dispatch until its result is
delivered: the dispatch awaiting its acknowledgement (docs/agent-guide.md, "What it does"; only then does
its trainer start), the running trainer, then the result, journaled (journal.py) before it is reported and
held until the orchestrator answers. One job at a time holds a slot unless the orchestrator answered the
registration with ``max_jobs`` > 1: then each job_submit starts at once on the GPUs it names.
"""

import logging
import socket
from dataclasses import dataclass, field
from pathlib import Path

from . import journal, protocol, supervisor
from . import progress as progress_protocol
from .artifacts import ArtifactTransfer, TransferError
from .backoff import Backoff
from .client import FatalError, Refused, Rejected, TransientError
from .runner import STOP_ABANDON, STOP_AGENT_EXIT, STOP_CANCEL, WORKER_GPUS, describe_exit, exit_report

logger = logging.getLogger("worker_agent")

PROGRESS_REPORT_INTERVAL = 1.0  # at most one progress report a second
CONSOLE_PROGRESS_INTERVAL = 5.0
FINISHED_ATTEMPTS_KEPT = 100
# How long a dispatch may wait for its acknowledgement when the orchestrator does not say
# (``dispatch_ack_timeout`` in the register response); measured from the job_submit's arrival.
DEFAULT_DISPATCH_ACK_TIMEOUT = 60.0
ACK_RETRY_CAP = 10.0  # the acknowledgement's backoff cap: several tries fit in the deadline
RECEIVED_KEY = "_received"  # added to a job_submit kept in ``waiting``: when it arrived (agent clock)
REPORT_RETRY_CAP = 30.0
# The job_submit fields that say where on the worker, and with whom, a job runs (protocol.JobSubmitEvent).
PLACEMENT_FIELDS = ("gpu_indices", "num_nodes", "node_rank", "master_addr", "master_port")


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


@dataclass
class JobSlot:
    """Everything the agent holds for one job: at most one of ``ack`` (its dispatch, not acknowledged yet),
    ``run`` (its trainer) and ``report`` (its result, not delivered yet; ``journal`` is its outcome.json)."""

    job_id: str
    gpu_indices: tuple | None = None  # the GPUs it was given (None: the whole worker)
    ack: PendingAck | None = None
    run: object = None
    report: dict | None = None
    journal: Path | None = None
    report_due: float | None = None
    ack_backoff: Backoff = field(default_factory=lambda: Backoff(cap=ACK_RETRY_CAP))
    report_backoff: Backoff = field(default_factory=lambda: Backoff(cap=REPORT_RETRY_CAP))
    last_progress_report: float | None = None
    reported_version: int = -1
    last_console: float | None = None
    console_version: int = -1

    @property
    def attempt(self):
        """The attempt (lease id) the slot holds the job under, or None."""
        if self.run is not None:
            return self.run.attempt
        if self.ack is not None:
            return self.ack.attempt
        if self.report is not None:
            return self.report.get("attempt")
        return None

    @property
    def holds_gpus(self):
        """Whether its GPUs are taken: its dispatch will run, or its trainer runs."""
        return self.ack is not None or self.run is not None


def placement_of(data):
    """Return the placement fields a job_submit carries (``PLACEMENT_FIELDS``), or None when it carries none."""
    placement = {key: data[key] for key in PLACEMENT_FIELDS if data.get(key) is not None}
    return placement or None


def port_free(port):
    """Whether nothing listens on TCP ``port`` of this host: rank 0's trainer must be able to listen there. Probed by
    binding it (as a trainer would, SO_REUSEADDR) and closing at once, so nothing holds it when the trainer starts."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("", port))
    except OSError:
        return False
    finally:
        probe.close()
    return True


def _is_int(value):
    return isinstance(value, int) and not isinstance(value, bool)


class JobsMixin:
    """The jobs the agent holds, one ``JobSlot`` each: submit, acknowledge, start, progress, the result (retried until
    delivered), cancel, abandon."""

    # --- the slots ----------------------------------------------------------------------------

    @property
    def job(self):
        """The first running trainer (JobRun), or None."""
        return next((slot.run for slot in self.slots.values() if slot.run is not None), None)

    @property
    def pending_ack(self):
        """The first dispatch awaiting its acknowledgement (PendingAck), or None."""
        return next((slot.ack for slot in self.slots.values() if slot.ack is not None), None)

    @property
    def pending_report(self):
        """``(job_id, body)`` of the first result not delivered yet, or None."""
        return next(((slot.job_id, slot.report) for slot in self.slots.values() if slot.report is not None), None)

    @property
    def report_due(self):
        """When the next undelivered result is reported again, or None."""
        return min((s.report_due for s in self.slots.values() if s.report is not None and s.report_due is not None), default=None)

    @property
    def multi(self):
        """Whether the orchestrator sends this agent several jobs at once (its register answer's ``max_jobs`` > 1)."""
        return self.max_jobs > 1

    def running_slots(self):
        return [slot for slot in self.slots.values() if slot.run is not None]

    def report_slots(self):
        return [slot for slot in self.slots.values() if slot.report is not None]

    def _holds(self, slot):
        """Whether ``slot`` is still one of the agent's (a call made since may have ended it)."""
        return self.slots.get(slot.job_id) is slot and self.exit_code is None

    def _free(self, slot):
        """Forget ``slot`` (its job ended here: not started, stopped unreported, or its result delivered)."""
        if self.slots.get(slot.job_id) is slot:
            del self.slots[slot.job_id]

    def current_job_id(self):
        """Return the first job this agent holds: running, awaiting its acknowledgement, or awaiting its result's delivery."""
        return next(iter(self.slots), None)

    def current_attempt(self):
        """Return the attempt (lease id) of ``current_job_id()``, or None."""
        slot = next(iter(self.slots.values()), None)
        return slot.attempt if slot is not None else None

    def held_jobs(self):
        """Every job this agent holds, as ``protocol.RunningJob``s (the first is ``current_job_id()``)."""
        return [{"job_id": slot.job_id, "attempt": slot.attempt} for slot in self.slots.values()]

    # --- dispatches ---------------------------------------------------------------------------

    def on_job_submit(self, data):
        job_id, attempt = data.get("job_id"), data.get("attempt")
        if not job_id:
            logger.warning("Ignoring a job_submit without job_id")
            return
        job_id = str(job_id)
        slot = self.slots.get(job_id)
        if slot is not None and slot.run is not None and attempt in (None, slot.run.attempt):
            return  # delivered again (replay or redelivery): already running it
        if slot is not None and slot.ack is not None:
            if attempt in (None, slot.ack.attempt):
                return  # delivered again while its acknowledgement is under way
            # The orchestrator took the earlier dispatch back and dispatched the job anew: that one wins.
            logger.info(
                "Job %s dispatched again (attempt %s); the earlier dispatch (%s) is dropped", job_id, attempt, slot.ack.attempt
            )
            self._drop_ack(slot)
        if attempt and attempt in self.finished_attempts:
            return  # an old dispatch replayed after a reconnect
        slot = self.slots.get(job_id)
        if slot is not None and slot.report is not None and attempt == slot.report.get("attempt"):
            return
        if self.signals:
            logger.info("Job %s arrived while stopping; not started (the orchestrator requeues it at disconnect)", job_id)
            return
        if not self._has_room(job_id, data):
            if all(w.get("attempt") != attempt or w.get("job_id") != job_id for w in self.waiting):
                self.waiting.append({**data, RECEIVED_KEY: self.clock()})
                logger.info("Job %s arrived while job %s is busy; it starts next", job_id, self.current_job_id())
            return
        self._take(data)

    def _has_room(self, job_id, data=None):
        """Whether a dispatch of ``job_id`` (the job_submit ``data``) may start now: one job at a time; or, several at
        once, none of its own and none of its GPUs taken by a trainer being stopped. The orchestrator gives a job's
        GPUs back once it decides the job is over here (an attempt superseded by an earlier one's completion, an
        abandoned one), before its trainer has stopped: the dispatch waits for that, rather than being refused
        (only a GPU a job runs on, not being stopped, refuses it: ``_placement_problem``)."""
        if not self.multi:
            return not self.slots
        if job_id in self.slots:
            return False
        indices = (data or {}).get("gpu_indices")
        if indices is not None and not isinstance(indices, list):
            return True  # refused by _placement_problem
        for slot in self.slots.values():
            stopping = slot.run is not None and slot.run.stop_reason is not None
            if stopping and (indices is None or slot.gpu_indices is None or set(indices) & set(slot.gpu_indices)):
                return False
        return True

    def _take(self, data):
        """Start the dispatch ``data``, or report it failed when where it is to run is impossible here."""
        problem = self._placement_problem(data)
        if problem is None:
            self.start_job(data)
            return
        job_id, attempt = str(data["job_id"]), data.get("attempt")
        logger.error("Job %s not started: %s", job_id, problem)
        self._remember_attempt(attempt)
        failure: protocol.JobReport = {"status": protocol.FAILED, "attempt": attempt, "error": f"not started on this worker: {problem}"}
        self._queue_report(job_id, failure, journal_it=False)  # nothing ran: the orchestrator requeues it by its retry rules

    def _placement_problem(self, data):
        """Return why the job_submit ``data`` cannot run here (its GPUs, its rendezvous), or None."""
        indices = data.get("gpu_indices")
        mine = [slot for slot in self.slots.values() if slot.holds_gpus]
        if indices is None:
            if mine:
                return f"it asks for the whole worker while job {mine[0].job_id} runs on it"
        else:
            if not isinstance(indices, list) or not indices or not all(_is_int(i) for i in indices) or len(set(indices)) != len(indices):
                return f"gpu_indices must be a list of distinct GPU indices, got {indices!r}"
            outside = [i for i in indices if i not in self.gpu_slots]
            if outside:
                slots = ",".join(map(str, self.gpu_slots)) or "none"
                return f"GPU {','.join(map(str, outside))} is not one of this worker's GPUs ({slots})"
            for slot in mine:
                taken = set(indices) if slot.gpu_indices is None else set(indices) & set(slot.gpu_indices)
                if taken:
                    return f"GPU {','.join(map(str, sorted(taken)))} is in use by job {slot.job_id}"
        nodes = data.get("num_nodes")
        if nodes is not None and (not _is_int(nodes) or nodes < 1):
            return f"num_nodes must be a whole number >= 1, got {nodes!r}"
        if nodes is not None and nodes > 1:
            rank, addr, port = data.get("node_rank"), data.get("master_addr"), data.get("master_port")
            if not _is_int(rank) or not 0 <= rank < nodes:
                return f"node_rank must be a whole number from 0 to {nodes - 1}, got {rank!r}"
            if not isinstance(addr, str) or not addr.strip():
                return f"a {nodes}-node job needs master_addr, got {addr!r}"
            if not _is_int(port) or not 0 < port < 65536:
                return f"a {nodes}-node job needs a master_port from 1 to 65535, got {port!r}"
            if rank == 0 and not port_free(port):
                return f"master_port {port} is in use on this worker (rank 0 listens there for the other members)"
        return None

    # --- acknowledging a dispatch -------------------------------------------------------------

    def start_job(self, data):
        """Acknowledge the dispatch ``data`` (a job_submit); its trainer starts once that is accepted.

        Acknowledged by: ``starting`` answered 200; a heartbeat naming the job and attempt answered
        with the job as the worker's; a re-register naming them answered with ``resume_job`` (or in
        ``resume_jobs``). Transient failures are retried with backoff until ``dispatch_ack_timeout``
        after arrival; then the job is given up without running. A refusal drops it.
        """
        job_id, attempt = str(data["job_id"]), data.get("attempt")
        received = data.get(RECEIVED_KEY, self.clock())
        indices = data.get("gpu_indices")
        slot = JobSlot(job_id=job_id, gpu_indices=tuple(indices) if indices is not None else None)
        slot.ack = PendingAck(
            data=data, job_id=job_id, attempt=attempt, received=received, deadline=received + self.dispatch_ack_timeout
        )
        self.slots[job_id] = slot
        self.send_acknowledgement(slot)

    def send_acknowledgement(self, slot):
        """Send ``starting`` for the slot's pending dispatch; start it, drop it, or schedule a retry, by the answer."""
        ack = slot.ack
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
            self._drop_ack(slot)
            self._after_job(reported=False)
            return
        except TransientError as exc:
            now = self.clock()
            delay = slot.ack_backoff.next_delay(exc.retry_after or 0)
            ack.due = now + delay
            logger.warning(
                "Could not acknowledge job %s (%s); not started yet: retrying in %.0fs (gives up in %.0fs)",
                ack.job_id,
                exc.message,
                delay,
                max(ack.deadline - now, 0),
            )
            return
        self._acknowledged(slot, "its starting report was accepted")

    def check_acknowledgements(self):
        """Give each pending dispatch up past its deadline, or send ``starting`` again when due."""
        for slot in [slot for slot in self.slots.values() if slot.ack is not None]:
            if not self._holds(slot) or slot.ack is None:
                continue
            ack = slot.ack
            now = self.clock()
            if now >= ack.deadline:
                logger.warning(
                    "Job %s not started: its dispatch (attempt %s) was not acknowledged within %.0fs; the orchestrator requeues it",
                    ack.job_id,
                    ack.attempt,
                    self.dispatch_ack_timeout,
                )
                self._drop_ack(slot)
                if self.registered:
                    # Say so at once: a registration without the job releases anything the orchestrator
                    # still holds for this worker (a `starting` applied whose answer was lost).
                    self.register_due = now
                self._after_job(reported=False)
            elif ack.due is not None and now >= ack.due:
                self.send_acknowledgement(slot)

    def _acknowledged(self, slot, how):
        """The slot's pending dispatch is acknowledged: start its trainer."""
        ack, slot.ack = slot.ack, None
        slot.ack_backoff.reset()
        logger.debug("job %s acknowledged: %s", ack.job_id, how)
        self._launch(slot, ack.data)

    def _drop_ack(self, slot):
        """Forget the slot's pending dispatch without running it (its attempt is remembered as over)."""
        if slot.ack is not None:
            self._remember_attempt(slot.ack.attempt)
        slot.ack = None
        self._free(slot)

    # --- running a job ------------------------------------------------------------------------

    def _placement(self, data):
        """The job_submit's placement; a job given the whole worker on GPUs ``--gpus`` chose among those NVML sees
        runs on those alone (``runner.WORKER_GPUS``)."""
        placement = placement_of(data)
        if self.config.gpus is not None and not self.gpu_slots_declared and not (placement or {}).get("gpu_indices"):
            placement = {**(placement or {}), WORKER_GPUS: list(self.gpu_slots)}
        return placement

    def _launch(self, slot, data):
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
            work_dir=self.jobs_dir,
            command=self.command,
            on_exit=lambda finished: self.inbox.put(("job_exited", finished)),
            grace=self.config.cancel_grace,
            clock=self.clock,
            placement=self._placement(data),
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
        slot.run = run
        slot.last_progress_report = None
        slot.reported_version = -1
        slot.console_version = -1
        slot.last_console = None  # the first progress line shows at once, then one every few seconds
        number = data.get("attempt_number")
        gpus = f" on GPU {','.join(map(str, slot.gpu_indices))}" if slot.gpu_indices is not None else ""
        logger.info(
            "Job %s started: %s%s%s, in %s", job_id, label, f" (attempt {number})" if number else "", gpus, run.job_dir
        )
        self.report_progress(slot, force=True)

    def report_progress(self, slot, *, force=False):
        run = slot.run
        now = self.clock()
        progress, version = run.snapshot()
        if not force:
            if version == slot.reported_version:
                return
            if slot.last_progress_report is not None and now - slot.last_progress_report < PROGRESS_REPORT_INTERVAL:
                return
        slot.last_progress_report = now
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
        slot.reported_version = version
        run.log_sent(chunk)

    def _console_progress(self, slot):
        run = slot.run
        progress, version = run.snapshot()
        now = self.clock()
        if not progress or version == slot.console_version:
            return
        if slot.last_console is not None and now - slot.last_console < CONSOLE_PROGRESS_INTERVAL:
            return
        slot.console_version = version
        slot.last_console = now
        logger.info("Job %s: %s", run.job_id, progress_protocol.format_progress(progress))

    def _refused(self, job_id, exc):
        """A report or heartbeat about ``job_id`` was refused (409): cancel or abandon it, by the refusal's code."""
        if exc.code == protocol.JOB_CANCELLED:
            self.on_job_cancel({"job_id": job_id})  # stopped and reported cancelled: frees the worker at once
        else:
            self.abandon(job_id, exc.message)

    def on_job_cancel(self, data):
        job_id = str(data.get("job_id") or "")
        slot = self.slots.get(job_id)
        if slot is not None and slot.run is not None:
            if slot.run.stop_reason is None:
                logger.info("Job %s cancelled by the orchestrator; stopping it", job_id)
                slot.run.stop(STOP_CANCEL)
            return
        if slot is not None and slot.ack is not None and data.get("attempt") in (None, slot.ack.attempt):
            logger.info("Job %s cancelled by the orchestrator before it started; not started", job_id)
            attempt = slot.ack.attempt
            self._drop_ack(slot)
            # Nothing ran: reported (not journaled) so that the orchestrator frees this worker at once.
            cancelled: protocol.JobReport = {
                "status": protocol.CANCELLED,
                "attempt": attempt,
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
        slot = self.slots.get(job_id)
        if slot is None:
            return
        if slot.run is not None:
            logger.warning("Abandoning job %s: %s", job_id, reason)
            slot.run.stop(STOP_ABANDON)
        elif slot.ack is not None:
            logger.warning("Dropping job %s before it started: %s", job_id, reason)
            self._drop_ack(slot)
            self._after_job(reported=False)
        elif slot.report is not None:
            # Only the report itself decides about a result: the orchestrator accepts the completion
            # of an attempt it took back while nothing else runs the job. Try it now.
            logger.info("Job %s is no longer this worker's (%s); reporting its result once more now", job_id, reason)
            slot.report_due = self.clock()
            self.deliver_report(slot)

    def on_job_exit(self, run):
        slot = next((slot for slot in self.slots.values() if slot.run is run), None)
        if slot is None:
            return
        slot.run = None
        self._remember_attempt(run.attempt)
        took = progress_protocol.format_seconds((run.finished_at or self.clock()) - (run.started_at or self.clock()))
        code = run.returncode
        body = exit_report(
            run.attempt, code, run.stop_reason, progress=run.snapshot()[0], log_tail=run.log_tail(), last_line=run.last_line()
        )
        if body is None:
            supervisor.settle(run.job_dir)
            self._free(slot)
            if run.stop_reason == STOP_AGENT_EXIT:
                # Not reported as a result: disconnecting hands the job back to the queue and takes this
                # worker offline in one step, so the requeued job cannot be dispatched straight back here.
                logger.info("Job %s stopped after %s (worker shutting down)", run.job_id, took)
                if not self.slots:
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
            job_dir = Path(self.jobs_dir) / job_id
            try:
                path = journal.write_outcome(job_dir, job_id, body, worker_id=self.worker_id)
            except OSError as exc:
                logger.warning("Could not write the result of job %s to disk (%s); it is held in memory only", job_id, exc)
            else:
                supervisor.settle(job_dir)  # the outcome supersedes the supervisor's record of the exit
        slot = self.slots.get(job_id)
        if slot is None:
            slot = self.slots[job_id] = JobSlot(job_id=job_id)
        slot.report = body
        slot.journal = path
        slot.report_backoff.reset()
        slot.report_due = self.clock()
        self.deliver_report(slot)

    def deliver_report(self, slot):
        """Report the slot's result; retry a transient failure later, or (stopping, no trainer left) exit keeping it on disk."""
        answer = self._send_result(slot.job_id, slot.report, slot.journal)
        if answer is None:
            return  # fatal
        if isinstance(answer, TransientError):
            if self.signals and not self.running_slots():
                self._exit_keeping_result(answer)
                return
            delay = slot.report_backoff.next_delay(answer.retry_after or 0)
            logger.warning("Could not report job %s (%s); retrying in %.0fs", slot.job_id, answer.message, delay)
            slot.report_due = self.clock() + delay
            return
        slot.report = None
        slot.journal = None
        slot.report_due = None
        self._free(slot)
        self._after_job(reported=True)
    def _send_result(self, job_id, body, path, *, minimal=False, legacy=False):
        """Report a result; return True once the orchestrator answered (the journal is then marked
        delivered), the TransientError to retry after, or None after a fatal error.

        A result rejected as sent (4xx: e.g. an output the orchestrator cannot take) is sent once more
        in its minimal form (``protocol.minimal_report``: no log, no progress), which it always accepts.
        A ``legacy`` result (an older agent's, of no known worker) that the orchestrator says is not this
        worker's job is left on disk untouched, for the agent of the worker it is.
        """
        try:
            self.client.report(job_id, body)
        except Refused as exc:
            if legacy and exc.code == protocol.JOB_NOT_OWNED:
                logger.info("Job %s is not this worker's: its result (%s) is left for its own worker's agent", job_id, path)
                return True
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
                return self._send_result(job_id, protocol.minimal_report(body), path, minimal=True, legacy=legacy)
            logger.error("The orchestrator rejected the result of job %s: %s", job_id, exc)
        if path is not None:
            journal.mark_delivered(path)
        return True

    def _exit_keeping_result(self, exc):
        """Stopping, and a result cannot be delivered now: exit 0 and leave the results held to the next start.

        No disconnect: the orchestrator keeps the jobs on this worker, so a result reported at the
        next start is applied as any other.
        """
        for slot in self.report_slots():
            if slot.journal is not None:
                where = f"kept in {slot.journal}; the agent reports it when it starts again"
            else:
                where = "it could not be written to disk and is lost"
            logger.warning("Exiting without delivering the result of job %s (%s): %s", slot.job_id, exc.message, where)
        self.exit_code = 0

    def deliver_journaled(self):
        """Report the results journaled before this agent started, oldest first; return True once none is left.

        Called before registering: a registration that does not name the job would make the
        orchestrator take it back first. A transient failure schedules the next try (``register_due``).
        """
        while self.journaled:
            (path, job_id, body), legacy = self.journaled[0]
            # "journal": says it was read back from disk
            answer = self._send_result(job_id, {**body, "journal": True}, path, legacy=legacy)
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
            if legacy and path.exists():
                continue  # another worker's job: left in place for its agent (said by _send_result)
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
        """A job ended here (not started, stopped unreported, or its result delivered): leave once the last one
        has when stopping, drained or ephemeral; else start what waits."""
        if reported:
            self.jobs_reported += 1
        if self.exit_code is not None:
            return
        if self.signals:
            if not self.slots:
                self.leave("stopping after the signal")
        elif self.jobs_reported and not self.config.persistent:
            if not self.slots:
                self.leave("ephemeral worker: its job is done")
        elif self.draining:
            if not self.slots:
                self._idle_drained()
        else:
            self._start_waiting()
            if not self.slots:
                logger.info("Waiting for jobs")

    def _start_waiting(self):
        """Start the dispatches that arrived while their room was taken, in order, while there is room."""
        while self.exit_code is None and not self.signals and not self.draining:
            ready = next((w for w in self.waiting if self._has_room(str(w.get("job_id")), w)), None)
            if ready is None:
                return
            self.waiting.remove(ready)
            self._take(ready)  # a refusal comes back through _after_job, which starts the next one
