"""The trainer's webhooks: a receiver on loopback for one job's events, and what each event means for its progress.

SimpleTuner's trainer prints no progress lines: it posts its progress, stages and errors as JSON to the
``raw`` webhooks in its config's ``webhook_config`` (``simpletuner/helpers/webhooks/``: ``send_raw`` posts
``{"type": "training.status" | "lifecycle.stage" | "notification" | "error" | ..., ...}`` with the entry's
``auth_token`` as ``X-API-Key``). The agent adds an entry of its own for each job (the user's entries stay):
a receiver on 127.0.0.1, on a free port, whose path and key are a per-job secret; a post without both is
refused. ``interpret`` says what an event means for the job: a progress update in the progress protocol's
fields (``progress.py``), and an error summary.
"""

import hmac
import json
import logging
import os
import secrets
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from .text import first_line

logger = logging.getLogger(__name__)

CONFIG_KEY = "webhook_config"
PATH_PREFIX = "/simpletuner-agent/"
KEY_HEADER = "X-API-Key"  # where SimpleTuner's raw webhook sends the entry's auth_token
MAX_EVENT_BYTES = 1 << 20  # a larger post (a validation image, base64) is read and dropped unparsed
READ_CHUNK = 1 << 16
REQUEST_TIMEOUT = 10.0  # seconds a connection may take to send its request
ERROR_MAX_CHARS = 1000
ERROR_SEVERITIES = ("error", "critical", "fatal")
# Metrics SimpleTuner sends that the progress already holds (loss, learning_rate, epoch) or that say nothing new.
PROMOTED_METRICS = ("loss", "learning_rate", "epoch")
DROPPED_METRICS = ("effective_batch_size", "total_batch_size")
TRAINING_STAGE = {"key": "training", "label": "Training"}


# --- what an event means ----------------------------------------------------------------------------


@dataclass
class Meaning:
    """What one trainer event says: ``update``, progress-protocol fields (not yet normalised), and ``error``,
    a one-line failure summary, ranked (``error_rank``: 2 for the trainer's own ``error`` event, 1 otherwise)."""

    update: dict | None = None
    error: str | None = None
    error_rank: int = 0


def _dict(value):
    return value if isinstance(value, dict) else {}


def _training_status(event):
    data, progress = _dict(event.get("data")), _dict(event.get("progress"))
    status = data.get("status") or event.get("status")
    metrics = _dict(progress.get("metrics"))
    update = {
        "step": progress.get("current", data.get("global_step")),
        "total_steps": progress.get("total", data.get("total_num_steps")),
        "eta_seconds": progress.get("eta_seconds"),
        "loss": metrics.get("loss"),
        "learning_rate": metrics.get("learning_rate"),
        "epoch": metrics.get("epoch", data.get("current_epoch")),
        "metrics": {k: v for k, v in metrics.items() if k not in PROMOTED_METRICS + DROPPED_METRICS},
    }
    percent = progress.get("percent")
    if isinstance(percent, (int, float)) and not isinstance(percent, bool) and (update["step"] is None or update["total_steps"] is None):
        update["fraction"] = percent / 100.0
    message = first_line(event.get("message") or "", ERROR_MAX_CHARS)
    if isinstance(status, str) and status:
        update["stage"] = {**TRAINING_STAGE, "status": status}
    if status == "failed":
        return Meaning(update=update, error=message or "training failed", error_rank=1)
    return Meaning(update=update)


def _lifecycle_stage(event, previous_stage):
    stage = _dict(event.get("stage"))
    progress = _dict(stage.get("progress"))
    label = stage.get("label") or progress.get("label")
    if not label and previous_stage and previous_stage.get("key") == stage.get("key"):
        label = previous_stage.get("label")  # progress updates within a stage often leave the label out
    update = {
        "stage": {
            "key": stage.get("key"),
            "label": label,
            "status": stage.get("status"),
            "message": event.get("message"),
            "current": progress.get("current"),
            "total": progress.get("total"),
            "percent": progress.get("percent"),
        }
    }
    if stage.get("status") == "failed":
        error = first_line(event.get("message") or "", ERROR_MAX_CHARS) or f"{first_line(label or stage.get('key') or 'a stage', 200)} failed"
        return Meaning(update=update, error=error, error_rank=1)
    return Meaning(update=update)


def _error_text(event):
    title = first_line(event.get("title") or "", ERROR_MAX_CHARS)
    message = first_line(event.get("message") or "", ERROR_MAX_CHARS)
    if event.get("type") == "error" and title and message and message not in title:
        return f"{title}: {message}"[:ERROR_MAX_CHARS]
    return message or title


def interpret(event, previous_stage=None):
    """Return the ``Meaning`` of one webhook payload from the trainer; an empty one for anything else.

    ``training.status`` gives step, total, percent, ETA, loss, learning rate, epoch and the other numeric
    metrics, and the stage "Training" with its status (``failed``: an error); ``lifecycle.stage`` gives
    the stage (key, label, status, message, its own current/total/percent; ``failed``: an error); the
    trainer's ``error`` event and any event of severity error or critical give an error. The trainer's
    log records (``log.message``) are its output already and mean nothing here. Never raises.
    """
    if not isinstance(event, dict):
        return Meaning()
    kind = event.get("type")
    if kind == "log.message":
        return Meaning()
    if kind == "training.status":
        return _training_status(event)
    if kind == "lifecycle.stage":
        return _lifecycle_stage(event, previous_stage if isinstance(previous_stage, dict) else None)
    if kind == "error" or event.get("severity") in ERROR_SEVERITIES:
        text = _error_text(event)
        if text:
            return Meaning(error=text, error_rank=2 if kind == "error" else 1)
    return Meaning()


# --- the job's webhook_config ------------------------------------------------------------------------


def with_entry(existing, entry, job_dir):
    """Return the ``webhook_config`` value holding the user's entries and then ``entry``, as a list.

    ``existing`` is what the job's config says: nothing, an entry (object), a list of entries, a JSON
    string of either, or the path of a JSON file holding either (relative to ``job_dir``, where the
    trainer runs), as SimpleTuner accepts. Return None when it cannot be read (the config then keeps it as
    it is, and the trainer reports on it). An entry an agent added for another job is left out.
    """
    value = existing
    if isinstance(value, str):
        text = value.strip()
        if not text:
            value = None
        elif text[:1] in "[{":
            try:
                value = json.loads(text)
            except ValueError:
                return None
        else:
            try:
                value = json.loads((Path(job_dir) / os.path.expanduser(text)).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                return None
    if value is None:
        return [entry]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return None
    return [hook for hook in value if not _agents_entry(hook)] + [entry]


def _agents_entry(hook):
    """Whether ``hook`` is an entry an agent added for an earlier job (a config copied from a job directory):
    its receiver is gone, so it is dropped."""
    url = hook.get("callback_url") if isinstance(hook, dict) else None
    return isinstance(url, str) and url.startswith("http://127.0.0.1:") and PATH_PREFIX in url


# --- the receiver ------------------------------------------------------------------------------------


class WebhookReceiver:
    """An HTTP server on 127.0.0.1 (a free port) taking one job's trainer events; ``on_event(payload)`` is
    called for each authentic post whose body is a JSON object, in the server's request thread.

    A post is authentic when its path is ``PATH_PREFIX`` + the receiver's secret and its ``X-API-Key`` is
    that secret: anything else is refused (403) before its body is read. ``start()`` binds and serves
    (OSError if it cannot bind); ``stop()`` closes it.
    """

    def __init__(self, on_event, *, name="webhooks"):
        self.secret = secrets.token_urlsafe(32)
        self.name = name
        self._on_event = on_event
        self._server = None
        self._thread = None

    def start(self):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.daemon_threads = True
        server.receiver = self
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name=self.name, daemon=True)
        self._thread.start()
        return self

    @property
    def url(self):
        port = self._server.server_address[1]
        return f"http://127.0.0.1:{port}{PATH_PREFIX}{self.secret}"

    def config_entry(self):
        """The ``webhook_config`` entry that sends the trainer's events here (SimpleTuner's ``raw`` webhook)."""
        return {"webhook_type": "raw", "callback_url": self.url, "auth_token": self.secret}

    def authentic(self, path, key):
        expected = (PATH_PREFIX + self.secret).encode()
        path_ok = hmac.compare_digest(str(path or "").encode("utf-8", "replace"), expected)
        key_ok = hmac.compare_digest(str(key or "").encode("utf-8", "replace"), self.secret.encode())
        return path_ok and key_ok

    def deliver(self, payload):
        """Hand one event to ``on_event``; log (never raise) what it raises."""
        try:
            self._on_event(payload)
        except Exception:
            logger.exception("%s: a trainer event could not be handled", self.name)

    def stop(self):
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        self._server = None


class _Handler(BaseHTTPRequestHandler):
    server_version = "simpletuner-agent"
    timeout = REQUEST_TIMEOUT

    def do_POST(self):  # noqa: N802 - http.server's naming
        receiver = self.server.receiver
        if not receiver.authentic(self.path, self.headers.get(KEY_HEADER)):
            self.close_connection = True
            return self._answer(403, "forbidden")
        try:
            length = int(self.headers.get("Content-Length") or "")
        except ValueError:
            self.close_connection = True
            return self._answer(411, "a Content-Length is required")
        if length < 0:
            self.close_connection = True
            return self._answer(400, "bad Content-Length")
        if length > MAX_EVENT_BYTES:
            while length > 0:  # the trainer's own post (media): read it off the connection, keep nothing
                chunk = self.rfile.read(min(READ_CHUNK, length))
                if not chunk:
                    break
                length -= len(chunk)
            return self._answer(204)
        body = self.rfile.read(length)
        try:
            payload = json.loads(body)
        except (ValueError, RecursionError):
            return self._answer(400, "the body is not JSON")
        if not isinstance(payload, dict):
            return self._answer(400, "the body is not a JSON object")
        receiver.deliver(payload)
        return self._answer(204)

    def _answer(self, code, reason=None):
        body = json.dumps({"detail": reason}).encode() if reason else b""
        self.send_response(code)
        if body:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body:
            self.wfile.write(body)

    def log_message(self, format, *args):  # noqa: A002 - http.server's signature
        pass  # its request lines hold the secret path; what matters is logged by the agent itself
