"""The user's command line as an HTTP client of the public REST API: credentials, requests, errors, the change feed.

No Django here: everything goes over HTTP, as any third-party client would.
"""

import json
import os
import stat
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit

import requests

from .errors import CLIError

# Exit statuses of the user commands (`simpletuner jobs watch` adds 0/1/2 for the job's end).
TOOL_ERROR = 3

URL_ENV = "SIMPLETUNER_URL"
TOKEN_ENV = "SIMPLETUNER_TOKEN"
CONFIG_HOME_ENV = "XDG_CONFIG_HOME"
CONNECT_TIMEOUT_S = 10
READ_TIMEOUT_S = 60
# The operators' change feed sends a keep-alive every 20 s: a read that waits longer means a dead connection.
FEED_READ_TIMEOUT_S = 45
FEED_PATH = "/admin/live/changes"
USER_AGENT = "simpletuner-cli"


class Unreachable(CLIError):
    """The server did not answer: refused connection, unknown host, a timeout, a connection cut."""

    def __init__(self, message):
        super().__init__(message, TOOL_ERROR)


def credentials_path(environ=None):
    """Return the credentials file: ``$XDG_CONFIG_HOME/simpletuner/credentials``, else ``~/.config/...``."""
    environ = os.environ if environ is None else environ
    base = environ.get(CONFIG_HOME_ENV) or str(Path.home() / ".config")
    return Path(base) / "simpletuner" / "credentials"


@dataclass(frozen=True)
class Credentials:
    url: str
    token: str

    def __repr__(self):  # never the token
        return f"Credentials(url={self.url!r}, token=<hidden>)"


def normalise_url(raw):
    """Return ``raw`` as a server's base URL (scheme and host, any path, no trailing slash); raise CLIError if not one."""
    url = (raw or "").strip().rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise CLIError(f"not a server URL: {raw!r} (expected http://HOST:PORT or https://HOST)", TOOL_ERROR)
    return url


def save_credentials(credentials, path=None):
    """Write ``credentials`` to ``path`` (``credentials_path()``), readable by its owner only (0600), atomically."""
    path = Path(path or credentials_path())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, temporary = tempfile.mkstemp(prefix=".credentials-", dir=path.parent)
    try:
        os.fchmod(fd, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(fd, "w") as out:
            json.dump({"url": credentials.url, "token": credentials.token}, out)
            out.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


def load_credentials(environ=None, path=None):
    """Return the credentials to use: ``SIMPLETUNER_URL`` / ``SIMPLETUNER_TOKEN`` over the credentials file's. Raise
    CLIError (not logged in) when either is missing."""
    environ = os.environ if environ is None else environ
    path = Path(path or credentials_path(environ))
    stored = {}
    if not (environ.get(URL_ENV) and environ.get(TOKEN_ENV)) and path.exists():
        try:
            stored = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise CLIError(f"cannot read {path} ({exc}): run simpletuner login --url URL again", TOOL_ERROR) from None
        if not isinstance(stored, dict):
            raise CLIError(f"{path} is not a credentials file: run simpletuner login --url URL again", TOOL_ERROR)
    url = environ.get(URL_ENV) or stored.get("url")
    token = environ.get(TOKEN_ENV) or stored.get("token")
    if not url or not token:
        raise CLIError(
            f"not logged in: run simpletuner login --url {url or 'URL'} (or set {URL_ENV} and {TOKEN_ENV})", TOOL_ERROR
        )
    return Credentials(url=normalise_url(url), token=token)


def api_error(response, what, url="URL"):
    """Return the CLIError for an API error ``response`` to ``what`` (a request's description) of the server at
    ``url``, saying what to do."""
    try:
        body = response.json()
    except ValueError:
        body = {}
    detail = body.get("detail") if isinstance(body, dict) else None
    code = body.get("code") if isinstance(body, dict) else None
    status = response.status_code
    if status == 401:
        return CLIError(f"401: the token was revoked or expired (run simpletuner login --url {url} with a new one)", TOOL_ERROR)
    if status == 403:
        return CLIError(f"403: {detail or 'permission denied'} ({what})", TOOL_ERROR)
    if status == 429:
        wait = response.headers.get("Retry-After")
        return CLIError(f"429: {detail or 'throttled'}" + (f"; retry in {wait} s" if wait else ""), TOOL_ERROR)
    errors = body.get("errors") if isinstance(body, dict) else None
    extra = ""
    if isinstance(errors, dict):
        extra = "; " + "; ".join(f"{field}: {' '.join(map(str, msgs)) if isinstance(msgs, list) else msgs}" for field, msgs in errors.items())
    return CLIError(f"{status}{' ' + code if code else ''}: {detail or response.reason}{extra}", TOOL_ERROR)


class Client:
    """Calls the orchestrator's API as one operator (``Authorization: Bearer``). Every request has a timeout; every
    failure is a CLIError (exit status 3) that says what to do."""

    def __init__(self, credentials, *, session=None):
        self.credentials = credentials
        self.url = credentials.url
        self.session = session or requests.Session()
        self.session.headers["Authorization"] = f"Bearer {credentials.token}"
        self.session.headers["User-Agent"] = USER_AGENT

    def request(self, method, path, *, what=None, ok=(200,), timeout=None, **kwargs):
        """Send one request; return the response when its status is in ``ok``, else raise the CLIError."""
        what = what or f"{method} {path}"
        try:
            response = self.session.request(
                method, self.url + path, timeout=timeout or (CONNECT_TIMEOUT_S, READ_TIMEOUT_S), **kwargs
            )
        except requests.exceptions.SSLError as exc:
            raise CLIError(
                f"TLS failed with the server at {self.url} ({type(exc).__name__}); for a self-signed certificate set "
                "REQUESTS_CA_BUNDLE to its PEM file (simpletuner server prints where it is)",
                TOOL_ERROR,
            ) from None
        except requests.exceptions.ConnectionError:
            raise Unreachable(f"the server at {self.url} is unreachable (is it running? is the URL right?)") from None
        except requests.exceptions.Timeout:
            raise Unreachable(f"the server at {self.url} did not answer in time ({what})") from None
        if response.status_code not in ok:
            raise api_error(response, what, self.url)
        return response

    def get_json(self, path, **kwargs):
        return self.request("GET", path, **kwargs).json()

    def post_json(self, path, body=None, *, ok=(200, 201), **kwargs):
        return self.request("POST", path, json=body if body is not None else {}, ok=ok, **kwargs).json()

    # --- the API's resources -------------------------------------------------------------------------

    def job(self, job_id):
        """Return job ``job_id``'s detail; CLIError naming it when it does not exist."""
        return self._one(f"/api/queue/{quote(job_id, safe='')}", f"no job {job_id} on {self.url} (simpletuner jobs list shows them)")

    def _one(self, path, missing):
        response = self.request("GET", path, ok=(200, 404))
        if response.status_code == 404:
            raise CLIError(missing, TOOL_ERROR)
        return response.json()

    def config(self, name):
        return self._one(f"/api/configs/{quote(name, safe='')}", f"no stored config named {name} (simpletuner configs list)")

    def job_action(self, job_id, action):
        """POST ``/api/queue/{id}/{action}`` (cancel, retry); return the answer."""
        response = self.request("POST", f"/api/queue/{quote(job_id, safe='')}/{action}", json={}, ok=(200, 201, 404))
        if response.status_code == 404:
            raise CLIError(f"no job {job_id} on {self.url} (simpletuner jobs list shows them)", TOOL_ERROR)
        return response.json()

    def pages(self, path, *, params=None, limit=None):
        """Yield the items of a paginated list (``results``, following ``next``), at most ``limit``."""
        params = dict(params or {})
        params.setdefault("limit", min(limit or 200, 200))
        count = 0
        while path:
            body = self.get_json(path, params=params)
            items = body.get("results", body) if isinstance(body, dict) else body
            for item in items:
                yield item
                count += 1
                if limit is not None and count >= limit:
                    return
            following = body.get("next") if isinstance(body, dict) else None
            path, params = (_path_of(following), None) if following else (None, None)

    # --- the operators' change feed ---------------------------------------------------------------------

    def open_feed(self):
        """Open the operators' change feed (SSE); return an iterator of ``(event type, data)``. CLIError on refusal."""
        response = self.request(
            "GET",
            FEED_PATH,
            what="the change feed",
            stream=True,
            timeout=(CONNECT_TIMEOUT_S, FEED_READ_TIMEOUT_S),
            headers={"Accept": "text/event-stream"},
        )
        return FeedReader(response)


def _path_of(url):
    parts = urlsplit(url)
    return parts.path + (f"?{parts.query}" if parts.query else "")


class FeedReader:
    """Server-sent events from a streamed response: yields ``(type, data)``; data is JSON-decoded when it can be."""

    def __init__(self, response):
        self.response = response

    def close(self):
        self.response.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __iter__(self):
        return parse_sse(self.response.iter_content(chunk_size=None, decode_unicode=False))


def parse_sse(chunks):
    """Yield ``(event type, data)`` from SSE byte ``chunks`` (comments skipped; type ``message`` when unnamed)."""
    buffer = b""
    event, data = None, []
    for chunk in chunks:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8", "replace")
            if not line:
                if event is not None or data:
                    yield event or "message", _decoded("\n".join(data))
                event, data = None, []
            elif line.startswith(":"):
                continue
            else:
                field, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field == "event":
                    event = value
                elif field == "data":
                    data.append(value)


def _decoded(text):
    try:
        return json.loads(text) if text else None
    except ValueError:
        return text


class Backoff:
    """Exponential waits between reconnections (0.5 s doubling to 10 s), reset on success; ``sleep`` injectable."""

    def __init__(self, *, first=0.5, cap=10.0, sleep=time.sleep):
        self.first, self.cap, self.sleep = first, cap, sleep
        self.delay = first

    def wait(self):
        self.sleep(self.delay)
        self.delay = min(self.delay * 2, self.cap)

    def reset(self):
        self.delay = self.first
