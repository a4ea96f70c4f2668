"""Following a job as the server pushes its changes: `jobs watch`, `jobs submit --follow`, `jobs logs --follow`.

The operators' change feed (SSE) names a job each time its state, progress or log moves; the job is read
again on each such event, and when the feed opens (the subscription is in place then, so an end that came
between the first read and the opening is read too). The feed is a hint that may lose an event (a Redis
outage), so its keep-alive (every 20 s) is also a cue to read again. A cut connection is reopened, with
backoff, for RECONNECT_FOR_S; then the command gives up (exit status 3).
"""

import sys
import time
from urllib.parse import quote

import requests

from .client import TOOL_ERROR, Backoff, Unreachable
from .errors import CLIError
from .render import EXIT_FOR_STATUS, TERMINAL_STATUSES, EtaEstimator, progress_bar, progress_line, status_line

RECONNECT_FOR_S = 60
READ_AGAIN_ON = ("stream-open", "keep-alive")


def names_job(data, job_id):
    """Whether a feed ``changes`` event's ``data`` may concern job ``job_id`` (it names it, or says ``many``)."""
    if not isinstance(data, dict):
        return False
    if data.get("many"):
        return True
    return any(t.get("type") == "job" and t.get("id") == job_id for t in data.get("targets") or [] if isinstance(t, dict))


def until_done(client, job_id, read, *, clock=time.monotonic, backoff=None):
    """Call ``read()`` whenever job ``job_id`` may have changed, as the change feed tells, until it returns True.

    ``read`` is called once the feed is open (and on every reopening), on each event naming the job and on each
    keep-alive. Raise CLIError when the feed refuses us or ends with an error, or the server stays unreachable
    for RECONNECT_FOR_S."""
    backoff = backoff or Backoff()
    lost_at = None
    while True:
        try:
            with client.open_feed() as feed:
                for kind, data in feed:
                    if kind == "stream-error":
                        detail = data.get("text") or data.get("condition") if isinstance(data, dict) else data
                        raise CLIError(f"the server ended the change feed: {detail}", TOOL_ERROR)
                    if kind in READ_AGAIN_ON or (kind == "changes" and names_job(data, job_id)):
                        if read():
                            return
                        lost_at = None
                        backoff.reset()
        except (Unreachable, requests.exceptions.RequestException) as exc:
            lost_at = lost_at if lost_at is not None else clock()
            if clock() - lost_at >= RECONNECT_FOR_S:
                message = str(exc) if isinstance(exc, CLIError) else f"lost the server at {client.url}"
                raise CLIError(f"{message}; gave up after {RECONNECT_FOR_S} s", TOOL_ERROR) from None
        backoff.wait()


class JobWatch:
    """Shows one job's changes: on a terminal a live progress bar with its state changes above it; elsewhere one
    plain line per change (``running on gpu-1``, ``step 120/500 loss 0.031``)."""

    def __init__(self, client, job_id, *, out=None, tty=None, clock=time.monotonic):
        self.client = client
        self.job_id = job_id
        self.out = out or sys.stdout
        self.tty = self.out.isatty() if tty is None else tty
        self.clock = clock
        self.eta = EtaEstimator()
        self.last_status = None
        self.last_progress = None
        self.bar_shown = False
        self.bar_text = ""
        self.job = None

    def run(self, job=None):
        """Follow the job to its end; return the exit status for it (0 completed, 1 failed, 2 cancelled)."""
        done = self.show(job) if job is not None else self.read()
        if not done:
            until_done(self.client, self.job_id, self.read, clock=self.clock)
        return self.finish()

    def read(self):
        """Read the job again and show what changed; return True once it has ended."""
        return self.show(self.client.job(self.job_id))

    def show(self, job):
        """Show what changed in ``job`` since the last read (the end after the last progress); return True at its end."""
        self.job = job
        ended = job["status"] in TERMINAL_STATUSES
        if ended and self.bar_shown:  # the end is said in plain lines, without a bar under them
            self.out.write("\r\x1b[2K")
            self.bar_shown = False
        if not ended:
            self._status(job)
        line = progress_line(job)
        if line and line != self.last_progress and job["status"] != "queued":
            self.last_progress = line
            if self.tty and not ended:
                progress = job.get("progress") or {}
                self._bar(progress_bar(job, eta=self.eta.eta(progress.get("step"), progress.get("total_steps"), self.clock())))
            else:
                self._line(line)
        if ended:
            self._status(job)
        return ended

    def _status(self, job):
        if job["status"] != self.last_status:
            self.last_status = job["status"]
            self._line(status_line(job))

    def finish(self):
        self.out.flush()
        return EXIT_FOR_STATUS[self.job["status"]]

    def _line(self, text):
        """Write a line above the bar (which is drawn again under it)."""
        if self.bar_shown:
            self.out.write("\r\x1b[2K" + text + "\n" + self.bar_text)
        else:
            self.out.write(text + "\n")
        self.out.flush()

    def _bar(self, text):
        self.out.write("\r\x1b[2K" + text)
        self.out.flush()
        self.bar_text, self.bar_shown = text, True


class LogFollower:
    """Prints a job's log attempt by attempt, from its first line, then the lines that come, until the job ends."""

    def __init__(self, client, job_id, *, out=None):
        self.client = client
        self.job_id = job_id
        self.out = out or sys.stdout
        self.attempt = 1
        self.offset = 0
        self.headed = False
        self.status = None
        self.last_part = None

    def chunk(self):
        path = f"/api/queue/{quote(self.job_id, safe='')}/log"
        return self.client.get_json(path, params={"attempt": self.attempt, "offset": self.offset})

    def read(self):
        """Print what is new; return True once the job has ended and everything it logged is printed."""
        job = self.client.job(self.job_id)
        attempts, self.status = job.get("attempt_count") or 0, job["status"]
        while self.attempt <= attempts:
            part = self.last_part = self.chunk()
            if not self.headed:
                worker = next((a.get("worker_name") for a in job.get("attempts") or [] if a["number"] == self.attempt), None)
                self.out.write(f"# --- attempt {self.attempt} on {worker or 'a deleted worker'} ---\n")
                self.headed = True
            if part["skipped"]:
                self.out.write(f"# [{part['skipped']} characters were cut before they were read]\n")
            self.out.write(part["text"])
            self.offset = part["next_offset"]
            self.out.flush()
            if self.attempt < part["attempts"] and part["outcome"]:
                self.attempt, self.offset, self.headed = self.attempt + 1, 0, False
                attempts = max(attempts, part["attempts"])
                continue
            break
        # The job was read before its log: an end seen there came with its last lines, which are printed now; but a
        # cancelled job's worker sends its last lines when it has stopped the trainer (``stopping`` until then).
        return self.status in TERMINAL_STATUSES and not (self.last_part or {}).get("stopping")

    def run(self):
        if not self.read():
            until_done(self.client, self.job_id, self.read)
        return EXIT_FOR_STATUS[self.status]
