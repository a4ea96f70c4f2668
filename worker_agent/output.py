"""A trainer's output as the agent reports it: text lines, progress (from its lines and its webhook events), and
the line that sums up a failure."""

import collections
import itertools
import json
import os
from pathlib import Path

from . import progress as progress_protocol
from . import protocol, webhooks
from .text import plain, says_something

TAIL_LINES = 200  # kept in memory; the last REPORTED_TAIL_LINES are sent to the orchestrator
UNSENT_MAX_LINES = 20_000  # output lines kept until the orchestrator has them (older ones are then lost, and said so)
REPORTED_TAIL_LINES = 50
MAX_LINE_CHARS = 2000
LOG_FILE = "train.log"
ERROR_FILE = "trainer_error.json"  # the trainer's own error event, for a restarted agent: {"error", "rank"}
TRACEBACK_HEADER = "Traceback (most recent call last):"
CHAINED_TRACEBACK = ("During handling of the above exception", "The above exception was the direct cause")
STAGE_LINE_PREFIX = "[stage] "  # the agent's line in the job's log when the trainer's stage changes


def split_lines(data):
    """Split trainer output into ``(complete lines, the rest)``; CR, LF and CRLF all end a line, and an
    over-long unterminated line is cut into a line of its own."""
    *lines, rest = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
    if len(rest) > MAX_LINE_CHARS * 4:
        lines.append(rest)
        rest = b""
    return lines, rest


def _stage_moved(before, after):
    return bool(after) and (not before or (before.get("key"), before.get("status")) != (after.get("key"), after.get("status")))


class Output:
    """A trainer's output as the agent reports it: lines as text (terminal escape sequences and control
    characters removed; blank lines dropped), ``SIMPLETUNER_PROGRESS`` lines and webhook events folded into
    ``progress``, the other lines kept as a tail, and the trainer's own error event kept for the summary.
    ``version`` changes with every change. Not locked."""

    def __init__(self):
        self.progress = {}
        self.version = 0
        self.tail = collections.deque(maxlen=TAIL_LINES)
        self.lines_total = 0  # output lines so far (progress lines not counted)
        self.unsent = collections.deque(maxlen=UNSENT_MAX_LINES)  # the last lines not yet accepted
        self.error = None  # the trainer's error event, one line (webhooks.interpret)
        self.error_rank = 0

    def add(self, raw):
        """Fold one line of output (bytes, any encoding: invalid UTF-8 is replaced)."""
        text = plain(raw.decode("utf-8", errors="replace")).rstrip()
        update = progress_protocol.parse_line(text)
        if update is not None:
            self.progress = progress_protocol.merge(self.progress, update)
        elif text.strip():
            self._keep(text)
        else:
            return
        self.version += 1

    def _keep(self, text):
        self.tail.append(text[:MAX_LINE_CHARS])
        self.unsent.append(text[:MAX_LINE_CHARS])
        self.lines_total += 1

    def event(self, payload):
        """Fold one webhook event of the trainer (``webhooks.interpret``); return the new stage when the
        stage moved (another stage, or another status), else None. A moved stage is a line of the log."""
        meaning = webhooks.interpret(payload, self.progress.get("stage"))
        update = progress_protocol.normalise(meaning.update) if meaning.update else {}
        moved = None
        if update:
            before = self.progress.get("stage")
            self.progress = progress_protocol.merge(self.progress, update)
            if _stage_moved(before, update.get("stage")):
                moved = update["stage"]
                line = STAGE_LINE_PREFIX + progress_protocol.format_stage(moved)
                self._keep(f"{line} - {moved['message']}" if moved.get("message") else line)
        if meaning.error and meaning.error_rank >= self.error_rank:
            self.error, self.error_rank = meaning.error, meaning.error_rank
        if update or meaning.error:
            self.version += 1
        return moved

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
        """Return the line that sums up the output, for a failure's reason: the trainer's own error event;
        else the last line of the last traceback (the exception); else the last line that says something
        (a letter or a digit). Never a blank or control-only line; "" when there is none."""
        if self.error:
            return self.error
        lines = [line for line in self.tail if not line.startswith(STAGE_LINE_PREFIX)]
        for index in range(len(lines) - 1, -1, -1):
            if TRACEBACK_HEADER in lines[index]:
                for line in lines[index + 1 :]:
                    if not line[:1].isspace() and says_something(line) and not line.startswith(CHAINED_TRACEBACK):
                        return line.strip()
                break
        for line in reversed(lines):
            if says_something(line):
                return line.strip()
        return ""


def write_error(job_dir, output):
    """Keep ``output``'s error event in ``<job_dir>/trainer_error.json`` for a restarted agent; never raise."""
    path = Path(job_dir) / ERROR_FILE
    tmp = path.with_name(f".{ERROR_FILE}.tmp")
    try:
        tmp.write_text(json.dumps({"error": output.error, "rank": output.error_rank}), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def read_log(job_dir, *, max_bytes=1 << 20):
    """Return the ``Output`` of the last ``max_bytes`` of ``<job_dir>/train.log`` (empty if there is none), with
    the trainer's error event if one was kept: what a restarted agent knows of a trainer that ended while no
    agent was watching."""
    output = Output()
    try:
        record = json.loads((Path(job_dir) / ERROR_FILE).read_text(encoding="utf-8"))
        if isinstance(record, dict) and isinstance(record.get("error"), str) and record["error"]:
            output.error, output.error_rank = record["error"], record.get("rank") or 1
    except (OSError, ValueError):
        pass
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
