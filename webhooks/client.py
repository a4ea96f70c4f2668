"""One POST of a delivery: to the address its URL was checked against (``webhooks.addresses``), with a total timeout.

Redirects are not followed (a 3xx is an answer like any other) and no proxy from the environment is used: the
connection goes to the checked address and nowhere else.
"""

import http.client
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from .addresses import AddressRefused, checked_addresses, target

TIMEOUT_S = 10.0  # connect, send and the answer's status line and headers, all together
USER_AGENT = "SimpleTuner-Webhooks/1"


@dataclass(frozen=True)
class Answer:
    """What an attempt came to: an HTTP status code, or an error in its place (``refused``: not to be retried)."""

    status_code: int | None = None
    error: str = ""
    refused: bool = False
    retry_after: float | None = None
    duration_ms: int = 0


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """``HTTPConnection`` to ``host`` (its Host header) whose socket connects to ``address``."""

    def __init__(self, host, port, *, address, timeout):
        super().__init__(host, port, timeout=timeout)
        self.address = address

    def _socket(self):
        return socket.create_connection((self.address, self.port), self.timeout)

    def connect(self):
        self.sock = self._socket()


class _PinnedHTTPSConnection(http.client.HTTPSConnection):
    """``HTTPSConnection`` to ``host`` (its Host header, SNI and certificate check) whose socket connects to ``address``."""

    def __init__(self, host, port, *, address, timeout):
        super().__init__(host, port, timeout=timeout, context=ssl.create_default_context())
        self.address = address

    def connect(self):
        sock = socket.create_connection((self.address, self.port), self.timeout)
        self.sock = self._context.wrap_socket(sock, server_hostname=self.host)


def post(url, body, headers, *, timeout=TIMEOUT_S, clock=time.monotonic):
    """POST ``body`` (bytes) to ``url`` with ``headers``; return an ``Answer``. Never raises for a network failure."""
    started = clock()
    try:
        addresses = checked_addresses(url)
    except AddressRefused as exc:
        return Answer(error=str(exc), refused=not exc.transient, duration_ms=_ms(clock() - started))
    host, port, https = target(url)
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    connection_class = _PinnedHTTPSConnection if https else _PinnedHTTPConnection
    errors = []
    for address in addresses:
        remaining = timeout - (clock() - started)
        if remaining <= 0:
            break
        connection = connection_class(host, port, address=address, timeout=remaining)
        # The whole exchange is bounded: past the deadline the socket is shut, whatever it was waiting for.
        watchdog = threading.Timer(remaining, _shut, args=(connection,))
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.request("POST", path, body=body, headers={"User-Agent": USER_AGENT, **headers})
            response = connection.getresponse()
            retry_after = _seconds(response.getheader("Retry-After"))
            return Answer(status_code=response.status, retry_after=retry_after, duration_ms=_ms(clock() - started))
        except (OSError, http.client.HTTPException) as exc:
            late = clock() - started >= timeout
            errors.append(f"no answer within {timeout:g} s" if late else f"{address}: {_describe(exc)}")
            if late:
                break
        finally:
            watchdog.cancel()
            connection.close()
    return Answer(error="; ".join(errors) or f"no answer within {timeout:g} s", duration_ms=_ms(clock() - started))


def _shut(connection):
    sock = connection.sock
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _describe(exc):
    if isinstance(exc, (TimeoutError, socket.timeout)):
        return "timed out"
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or exc}"
    return " ".join(str(exc).split()) or type(exc).__name__


def _seconds(value):
    """Return a Retry-After header's delay in seconds (its delta-seconds form), or None."""
    try:
        return max(float(value), 0.0) if value is not None else None
    except ValueError:
        return None


def _ms(seconds):
    return max(int(seconds * 1000), 0)
