"""The agent's HTTP side of the worker protocol, with every failure sorted into fatal, transient or refused."""

import logging
import threading
from urllib.parse import urlsplit

import requests

from . import __version__, protocol
from .scheme_probe import speaks_plain_http, speaks_tls

logger = logging.getLogger(__name__)

HTTP_TIMEOUT = (5, 15)  # (connect, read) seconds for every call but the stream
STOPPING_TIMEOUT = (2, 3)  # once the agent is stopping: its last calls (a report, disconnect) must not hold it up
STREAM_READ_TIMEOUT = 65  # the orchestrator sends a keep-alive every 20 s; three missed means a dead link

FIX_UNREACHABLE = (
    "verify the orchestrator URL and port, check that firewall rules allow the connection, "
    "and that the orchestrator runs with --host 0.0.0.0"
)
FIX_TOKEN = (
    "the token may have been rotated: request a new one (admin → Workers → rotate token, or "
    "POST /api/admin/workers/{id}/token); check for whitespace in the token string"
)
FIX_BASE_URL = "pass the orchestrator's base URL, e.g. https://orchestrator.example.com:8001"
FIX_TLS = (
    "use --ca-cert PATH with the orchestrator's CA certificate (or add it to the system trust store); "
    "--ssl-no-verify accepts any certificate (self-signed, development only)"
)


class AgentError(Exception):
    """A failure the agent reports as one line: what happened and, when known, how to fix it."""

    def __init__(self, message, *, fix=""):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self):
        return f"{self.message}. Fix: {self.fix}" if self.fix else self.message


class FatalError(AgentError):
    """Retrying cannot help (refused token, bad URL, untrusted certificate): the agent exits non-zero."""


class TransientError(AgentError):
    """The orchestrator is unreachable or failing (connection error, timeout, 5xx, 429): retry later.

    ``retry_after`` is the server's Retry-After in seconds when it gave one.
    """

    def __init__(self, message, *, fix="", retry_after=None):
        super().__init__(message, fix=fix)
        self.retry_after = retry_after


class Refused(AgentError):
    """The orchestrator refused a report or heartbeat with 409 (a job or attempt no longer ours).

    ``code`` is the machine-readable reason (``protocol.JOB_CANCELLED``, ``JOB_NOT_OWNED``,
    ``STALE_ATTEMPT``...), the only thing the agent decides on; ``abandon_job`` the job id the agent
    must stop without reporting it.
    """

    def __init__(self, message, *, code="", abandon_job=None):
        super().__init__(message)
        self.code = code
        self.abandon_job = abandon_job


class Interrupted(BaseException):
    """Raised by ``OrchestratorClient.interrupt()`` (from a signal handler) into the call it interrupts.

    A BaseException, like KeyboardInterrupt, so that no library code on the way swallows it; the
    client turns it into a TransientError before it leaves the call.
    """


class Rejected(AgentError):
    """Any other 4xx: the request itself was wrong; retrying it unchanged cannot succeed."""

    def __init__(self, message, *, status):
        super().__init__(message)
        self.status = status


def _body(response):
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _retry_after(response):
    value = response.headers.get("Retry-After", "")
    try:
        return max(float(value), 0.0)
    except ValueError:
        return None


class OrchestratorClient:
    """Calls the orchestrator's worker endpoints with the worker's token.

    ``verify`` is True (system trust store), a CA bundle path (--ca-cert) or False (--ssl-no-verify).
    ``session`` is injectable for tests. Every call has a timeout; the token is sent only as a header
    and never appears in a message.
    """

    def __init__(self, url, token, *, verify=True, session=None, timeout=HTTP_TIMEOUT):
        self.base_url = url.rstrip("/")
        self.timeout = timeout
        self.session = session or requests.Session()
        self.session.headers.update(
            {protocol.WORKER_TOKEN_HEADER: token, "User-Agent": f"simpletuner-worker-agent/{__version__}"}
        )
        self.session.verify = verify
        # Passed on every request too: requests lets REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE override a
        # session-level setting, which would silently ignore --ca-cert and --ssl-no-verify.
        self.verify = verify
        self.worker_id = None
        # A wrong scheme is looked for once, at the first failure that suggests it, and never once the orchestrator
        # has answered over this URL: then a reset or a closed connection is the network's, not the scheme's.
        self._scheme_probed = False
        # in_call: this thread is inside a call interrupt() may break; settling: that call is a registration
        self._local = threading.local()

    def url(self, path):
        return f"{self.base_url}{path}"

    # --- the protocol ---------------------------------------------------------------------------

    def register(self, body: protocol.RegisterRequest) -> protocol.RegisterResponse:
        """POST REGISTER_PATH; return the response body (``worker_id``, ``resume_job``/``abandon_job``...)."""
        result = self._call("POST", protocol.REGISTER_PATH, json=body, settling=True)
        self.worker_id = result.get("worker_id") or self.worker_id
        return result

    def heartbeat(self, body: protocol.HeartbeatRequest) -> protocol.HeartbeatResponse:
        """POST HEARTBEAT_PATH; return the worker's state as the orchestrator sees it."""
        request: protocol.HeartbeatRequest = {"worker_id": self.worker_id, **body}
        return self._call("POST", protocol.HEARTBEAT_PATH, json=request)

    def report(self, job_id, body: protocol.JobReport) -> protocol.JobReportResponse:
        """POST job_status_path(job_id); raise Refused (409) when the job is no longer ours."""
        return self._call("POST", protocol.job_status_path(job_id), json=body)

    def has_jobs(self):
        """GET QUEUE_PATH: whether a queued job fits this worker."""
        response: protocol.QueueResponse = self._call("GET", protocol.QUEUE_PATH, params={"worker_id": self.worker_id})
        return bool(response.get("has_jobs"))

    def disconnect(self):
        """POST DISCONNECT_PATH (graceful shutdown)."""
        return self._call("POST", protocol.DISCONNECT_PATH, json={"worker_id": self.worker_id})

    def open_stream(self, *, last_event_id=None):
        """GET STREAM_PATH; return the open streaming response (the caller reads and closes it)."""
        headers = {"Accept": "text/event-stream", "Cache-Control": "no-cache"}
        if last_event_id:
            headers["Last-Event-ID"] = last_event_id
        params = {"worker_id": self.worker_id} if self.worker_id else None
        return self._send(
            "GET",
            protocol.STREAM_PATH,
            headers=headers,
            params=params,
            stream=True,
            timeout=(self.timeout[0], STREAM_READ_TIMEOUT),
        )

    def close(self):
        self.session.close()

    # --- stopping -------------------------------------------------------------------------------

    def stopping(self):
        """Use STOPPING_TIMEOUT from now on: the agent is leaving and must not wait long on anyone."""
        self.timeout = STOPPING_TIMEOUT

    def interrupt(self, *, force=False):
        """Break the call the current thread is blocked in (if any) by raising Interrupted into it.

        Meant for a signal handler: it runs on the main thread, between the interrupted system call
        and its retry, so the request ends at once (as a TransientError) instead of at its timeout.
        Outside a call it does nothing. A registration in flight is broken only with ``force``: the
        orchestrator may have registered the worker already, and only the answer's worker id lets the
        agent disconnect it (cut short, the worker would stay online until its heartbeat timeout); it is
        bounded by its own timeout.
        """
        if getattr(self._local, "in_call", False) and (force or not self._local.settling):
            self._local.in_call = False
            raise Interrupted()

    # --- transport and error sorting --------------------------------------------------------------

    def _call(self, method, path, *, settling=False, **kwargs):
        self._local.in_call, self._local.settling = True, settling
        try:
            response = self._send(method, path, **kwargs)
            try:
                return _body(response)
            finally:
                response.close()
        except Interrupted:
            raise TransientError(f"{method} {path} interrupted: the agent is stopping") from None
        finally:
            self._local.in_call = False

    def _send(self, method, path, *, timeout=None, **kwargs):
        url = self.url(path)
        try:
            response = self.session.request(method, url, timeout=timeout or self.timeout, verify=self.verify, **kwargs)
        except requests.exceptions.SSLError as exc:
            self._wrong_scheme()
            raise self._tls_error(exc) from None
        except requests.exceptions.ConnectionError as exc:
            # An HTTPS server closes a plain-HTTP request; a plain-HTTP server never answers a TLS handshake.
            closed = self._reason(exc) in ("connection closed by the server", "connection reset")
            if closed or (isinstance(exc, requests.exceptions.ConnectTimeout) and self.base_url.startswith("https:")):
                self._wrong_scheme()
            raise TransientError(
                f"cannot reach the orchestrator at {self.base_url}: {self._reason(exc)}", fix=FIX_UNREACHABLE
            ) from None
        except requests.exceptions.Timeout:
            if self.base_url.startswith("https:"):
                self._wrong_scheme()
            raise TransientError(f"the orchestrator at {self.base_url} did not answer {method} {path} in time") from None
        except requests.exceptions.InvalidURL as exc:
            raise FatalError(f"invalid orchestrator URL {self.base_url!r}: {exc}") from None
        except requests.exceptions.RequestException as exc:
            raise TransientError(f"{method} {path} failed: {exc.__class__.__name__}") from None
        self._scheme_probed = True  # an HTTP answer over this URL: its scheme is right
        if response.status_code < 400:
            return response
        body = _body(response)
        response.close()
        detail = str(body.get("detail") or response.reason or "").strip()
        status = response.status_code
        if status in (401, 403) and not body:
            # Not the worker API's JSON but a web page: e.g. the admin's CSRF refusal under a URL ending in /admin.
            raise FatalError(
                f"{self.base_url} has no worker API (HTTP {status} for {path} did not come from a worker API)",
                fix=FIX_BASE_URL,
            )
        if status == 401:
            raise FatalError(f"invalid token: the orchestrator refused it ({detail or 'HTTP 401'})", fix=FIX_TOKEN)
        if status == 403:
            raise FatalError(f"the orchestrator refused this worker: {detail or 'HTTP 403'}", fix=FIX_TOKEN)
        if status == 409:
            raise Refused(detail or "refused (HTTP 409)", code=str(body.get("code") or ""), abandon_job=body.get("abandon_job"))
        if status == 429 or status >= 500:
            raise TransientError(
                f"the orchestrator answered {method} {path} with HTTP {status}{': ' + detail if detail else ''}",
                retry_after=_retry_after(response),
            )
        if status == 404 and path == protocol.REGISTER_PATH:
            raise FatalError(f"{self.base_url} has no worker API (HTTP 404 for {path})", fix=FIX_BASE_URL)
        raise Rejected(f"{method} {path}: HTTP {status}{': ' + detail if detail else ''}", status=status)

    def _wrong_scheme(self):
        """Raise FatalError if the orchestrator's port speaks the other scheme than its URL says (probed once)."""
        if self._scheme_probed or self.timeout == STOPPING_TIMEOUT:
            return  # probed already, or the agent is leaving and must not wait on a probe
        self._scheme_probed = True
        parts = urlsplit(self.base_url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
        if not host:
            return
        other = self.base_url.replace(f"{parts.scheme}://", "http://" if parts.scheme == "https" else "https://", 1)
        if parts.scheme == "https" and speaks_plain_http(host, port):
            raise FatalError(
                f"{self.base_url} speaks plain HTTP, not HTTPS: the URL's scheme is wrong",
                fix=f"use --orchestrator-url {other} (or start the orchestrator with --ssl)",
            )
        if parts.scheme == "http" and speaks_tls(host, port):
            raise FatalError(
                f"{self.base_url} speaks HTTPS, not plain HTTP: the URL's scheme is wrong",
                fix=f"use --orchestrator-url {other} (with --ca-cert for a self-signed certificate)",
            )

    def _tls_error(self, exc):
        text = str(exc)
        host = urlsplit(self.base_url).hostname
        if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
            why = "certificate verify failed"
            if "self-signed" in text or "self signed" in text:
                why += " (self-signed certificate)"
            elif "Hostname mismatch" in text or "doesn't match" in text:
                why += f" (the certificate is not for {host})"
            return FatalError(f"SSL: {why} for {self.base_url}", fix=FIX_TLS)
        if "WRONG_VERSION_NUMBER" in text or "wrong version number" in text:
            return FatalError(
                f"SSL handshake with {self.base_url} failed: the server does not speak TLS on that port",
                fix="use an http:// URL, or start the orchestrator with --ssl",
            )
        return TransientError(f"TLS error talking to {self.base_url}: {self._reason(exc)}", fix=FIX_TLS)

    @staticmethod
    def _reason(exc):
        text = str(exc)
        for marker, reason in (
            ("Connection refused", "connection refused"),
            ("Name or service not known", "unknown host name"),
            ("nodename nor servname", "unknown host name"),
            ("Temporary failure in name resolution", "host name lookup failed"),
            ("timed out", "connection timed out"),
            ("No route to host", "no route to host"),
            ("Network is unreachable", "network unreachable"),
            ("Connection reset", "connection reset"),
            ("RemoteDisconnected", "connection closed by the server"),
        ):
            if marker in text:
                return reason
        return exc.__class__.__name__
