"""The agent's session with the orchestrator: registration, heartbeats, reconnecting, and the SSE stream reader.

``SessionMixin`` holds no state of its own: its methods run on the agent's main thread over the state
``Agent.__init__`` declares (agent.py). ``StreamReader`` is the one part that runs on its own thread.
"""

import logging
import socket
import threading
import time

import requests

from . import __version__, journal, protocol
from .client import AgentError, FatalError, Refused, Rejected, TransientError
from .jobs import DEFAULT_DISPATCH_ACK_TIMEOUT
from .sse import SSEParser

logger = logging.getLogger("worker_agent")

# What to do once another agent took this worker over (a shutdown with protocol.AGENT_REPLACED, or a registration
# refused with it).
REPLACED_FIX = (
    "run one agent per worker: stop one of the two, or give each agent a worker (and token) of its own "
    "(admin → Workers → Add worker)"
)
STABLE_STREAM_S = 30.0  # a stream that lived this long was healthy: reconnect at once
EPHEMERAL_GIVE_UP_S = 300.0  # an ephemeral agent stops retrying an unreachable orchestrator after this


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


def _positive_seconds(value, default):
    """Return ``value`` as a number of seconds > 0, or ``default`` when absent or invalid."""
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return default
    return seconds if seconds > 0 and seconds == seconds and seconds != float("inf") else default


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


class SessionMixin:
    """Registering (and registering again after the stream drops), heartbeats, an unreachable orchestrator."""

    def register(self):
        body: protocol.RegisterRequest = {
            "name": self.config.name,
            "persistent": self.config.persistent,
            "current_job_id": self.current_job_id(),
            "current_attempt": self.current_attempt(),
            "hostname": socket.gethostname(),
            "agent_version": __version__,
            **self.capabilities,
        }
        if self.gpu_slots:
            body["gpu_slots"] = list(self.gpu_slots)
        if self.gpu_slots_declared:
            body["gpu_slots_declared"] = True
        offered = min(len(self.gpu_slots), protocol.MAX_JOBS_MAX) if len(self.gpu_slots) >= 2 else None
        if offered is not None:
            body["max_jobs"] = offered
            body["running_jobs"] = self.held_jobs()
        if self.config.advertise_address:
            body["advertise_address"] = self.config.advertise_address
        body["multi_node"] = True  # jobs.PLACEMENT_FIELDS: it runs a member of a multi-node job
        try:
            result = self.client.register(body)
        except FatalError as exc:
            self.fatal(exc)
            return
        except Rejected as exc:
            self.fatal(FatalError(f"registration refused: {exc}"))
            return
        except (TransientError, Refused) as exc:
            if isinstance(exc, Refused) and exc.code == protocol.AGENT_REPLACED:
                # Another agent took the worker over while this one's link was cut (it was not told then).
                self.fatal(FatalError(exc.message, fix=REPLACED_FIX), disconnect=False)
                return
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
        if self.jobs_dir is None or self.jobs_dir.name != self.worker_id:
            self._first_registration_here()
            if self.exit_code is not None:
                return
        if self.config.heartbeat_interval is None and result.get("heartbeat_interval"):
            self.heartbeat_interval = float(result["heartbeat_interval"])
        self.dispatch_ack_timeout = _positive_seconds(result.get("dispatch_ack_timeout"), DEFAULT_DISPATCH_ACK_TIMEOUT)
        self._follow_max_jobs(result.get("max_jobs") if offered is not None else None, offered)
        logger.info(
            "%s as %s (%s) at %s",
            "Registered" if first else "Registered again",
            self.config.name,
            self.worker_id,
            self.config.orchestrator_url,
        )
        self._follow_the_workers_settings(result)
        acknowledged = self._reconcile(result)
        self.next_heartbeat = self.clock() + self.heartbeat_interval
        if not getattr(self.stream, "connected", False):
            self.stream.go()  # (a registration while the stream is up, after a given-up dispatch, keeps it)
        if result.get("draining"):
            self.start_drain("this worker is draining")
        elif result.get("draining") is False and self.draining:
            self.end_drain()
        elif self.current_job_id() is None and first:
            logger.info("Waiting for jobs")
        for slot in acknowledged:
            if self._holds(slot) and slot.ack is not None:
                self._acknowledged(slot, "re-registering naming it resumed it")

    def _first_registration_here(self):
        """This token was not yet known in the work dir (a first start, a rotated token): from now on this worker's
        job dirs are ``<work dir>/<worker id>``; results left there undelivered (by an agent with the worker's
        earlier token) are reported now."""
        if not self._use_jobs_dir(self.worker_id):
            return
        logger.info("Job directories: %s", self.jobs_dir)
        journal.recover_exits(self.jobs_dir, worker_id=self.worker_id)
        found = journal.undelivered(self.jobs_dir, worker_id=self.worker_id)
        if found:
            self.journaled = [(entry, False) for entry in found] + self.journaled
            self._announce_journaled("now")
            self.deliver_journaled()

    def _follow_the_workers_settings(self, result):
        """Say so when the orchestrator knows this worker by another name or type; follow its type."""
        known_as = result.get("name")
        if isinstance(known_as, str) and known_as and known_as != self.config.name:
            logger.warning(
                "The orchestrator knows this worker as %r, not %r (--name / SIMPLETUNER_WORKER_NAME); "
                "operators see both", known_as, self.config.name
            )
        worker_type = result.get("worker_type")
        persistent = {protocol.WORKER_PERSISTENT: True, protocol.WORKER_LOCAL: True, protocol.WORKER_EPHEMERAL: False}.get(worker_type)
        if persistent is not None and persistent != self.config.persistent:
            logger.warning(
                "This worker's type is %s, set by the operator who created it, and it wins over %s: this agent %s. "
                "For an agent that %s, start it with the token of %s worker (admin → Workers → Add worker, or "
                "POST /api/admin/workers with \"worker_type\": \"%s\")",
                worker_type,
                "--persistent" if self.config.persistent else "starting without --persistent",
                "stays online between jobs" if persistent else "exits after one job",
                "exits after one job" if persistent else "stays online between jobs",
                "an ephemeral" if persistent else "a persistent",
                protocol.WORKER_EPHEMERAL if persistent else protocol.WORKER_PERSISTENT,
            )
            self.config.persistent = persistent

    def _follow_max_jobs(self, answered, offered):
        """Run as many jobs at once as the register answer's ``max_jobs`` says (at most the slots ``offered``); one
        when it says nothing (an orchestrator that does not pack)."""
        max_jobs = 1
        if offered is not None and isinstance(answered, int) and not isinstance(answered, bool) and answered > 1:
            max_jobs = min(answered, offered)
        if max_jobs != self.max_jobs:
            if max_jobs > 1:
                logger.info("Runs up to %d jobs at once, each on its own GPUs", max_jobs)
            else:
                logger.info("Runs one job at a time (the orchestrator sends no more)")
        self.max_jobs = max_jobs

    def _reconcile(self, result):
        """Apply ``resume_job``/``abandon_job`` (and ``resume_jobs``/``abandon_jobs``, each alike); return the slots
        whose pending dispatch the answer acknowledged."""
        resumes = [result.get("resume_job")]
        abandons = [result.get("abandon_job")]
        if self.multi:
            resumes += result.get("resume_jobs") if isinstance(result.get("resume_jobs"), list) else []
            abandons += result.get("abandon_jobs") if isinstance(result.get("abandon_jobs"), list) else []
        acknowledged, resumed = [], set()
        for resume in resumes:
            if not isinstance(resume, dict) or resume.get("job_id") is None:
                continue
            job_id = str(resume["job_id"])
            slot = self.slots.get(job_id)
            if slot is None:
                continue
            resumed.add(job_id)
            if slot.ack is not None:
                if resume.get("attempt") in (None, slot.ack.attempt):
                    acknowledged.append(slot)
                # (Resumed under another attempt: not this dispatch's acknowledgement; `starting` settles it.)
                continue
            if slot.run is not None:
                if resume.get("attempt"):
                    slot.run.attempt = resume["attempt"]
                logger.info("The orchestrator confirmed job %s is still ours; it keeps running", job_id)
            if slot.report is not None:
                if resume.get("attempt"):
                    slot.report["attempt"] = resume["attempt"]
                slot.report_due = self.clock()
        for abandon in abandons:
            if abandon and str(abandon) not in resumed:
                self.abandon(str(abandon), "the orchestrator says it is no longer this worker's job")
        return acknowledged

    def heartbeat(self):
        job_id = self.current_job_id()
        body: protocol.HeartbeatRequest = {
            "status": protocol.AGENT_BUSY if job_id else protocol.AGENT_IDLE,
            "current_job_id": job_id,
        }
        if job_id and self.current_attempt():
            body["attempt"] = self.current_attempt()  # naming the attempt acknowledges a pending dispatch
        first = self.slots.get(job_id) if job_id else None
        if first is not None and first.run is not None:
            body["progress"] = first.run.snapshot()[0] or None
        named = list(self.slots.values()) if self.multi else None
        if named is not None:
            body["jobs"] = [self._heartbeat_job(slot) for slot in named]
        sample = self.monitor.sample()
        body.update({field: sample[field] for field in protocol.HEARTBEAT_METRIC_FIELDS if field in sample})
        self.next_heartbeat = self.clock() + self.heartbeat_interval
        ack = self.pending_ack
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
        elif result.get("draining") is False and self.draining:
            self.end_drain()
        if named is not None and isinstance(result.get("jobs"), list):
            self._follow_heartbeat_jobs(named, result["jobs"])
        elif ack is not None and self.pending_ack is ack and self.exit_code is None:
            held = result.get("current_job_id")
            # A server that says which attempt it holds acknowledged only that one (an older one says nothing).
            attempt_held = result.get("current_attempt", ack.attempt)
            if held is not None and str(held) == ack.job_id and attempt_held == ack.attempt:
                self._acknowledged(self.slots[ack.job_id], "a heartbeat naming it was accepted")

    def _heartbeat_job(self, slot):
        """One ``protocol.HeartbeatJob``: the job, its attempt (naming it acknowledges its dispatch), its progress and log."""
        entry: protocol.HeartbeatJob = {"job_id": slot.job_id, "attempt": slot.attempt}
        if slot.run is not None:
            entry["progress"] = slot.run.snapshot()[0] or None
            entry["log_tail"] = slot.run.log_tail()
        return entry

    def _follow_heartbeat_jobs(self, named, held_jobs):
        """Apply a heartbeat answer's ``jobs`` (what the orchestrator holds on this worker) to the slots ``named`` in
        the heartbeat: a dispatch it holds under the same attempt is acknowledged; a job it holds no more is abandoned."""
        held = {}
        for entry in held_jobs:
            if isinstance(entry, dict) and entry.get("job_id") is not None:
                held[str(entry["job_id"])] = entry.get("attempt")
        for slot in named:
            if not self._holds(slot):
                continue
            if slot.job_id not in held:
                self.abandon(slot.job_id, "the orchestrator no longer holds it on this worker")
            elif slot.ack is not None and held[slot.job_id] in (None, slot.ack.attempt):
                self._acknowledged(slot, "a heartbeat naming it was accepted")

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
