"""When the orchestrator's address does not answer as expected, find out whether its scheme is wrong.

An agent given ``https://`` for a plain-HTTP orchestrator waits out a TLS handshake the server never
answers; one given ``http://`` for an HTTPS orchestrator sees the connection closed. Both would be
retried for ever as network trouble. A short probe of the same port tells which scheme it speaks.
"""

import socket
import ssl

PROBE_TIMEOUT_S = 3.0


def speaks_plain_http(host, port, *, timeout=PROBE_TIMEOUT_S):
    """Return True if ``host:port`` answers a plain HTTP request with an HTTP status line."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as conn:
            conn.sendall(f"HEAD / HTTP/1.0\r\nHost: {host}\r\n\r\n".encode("ascii", "replace"))
            return conn.recv(5) == b"HTTP/"
    except OSError:
        return False


def speaks_tls(host, port, *, timeout=PROBE_TIMEOUT_S):
    """Return True if ``host:port`` completes a TLS handshake (its certificate is not checked here)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout) as raw:
            with context.wrap_socket(raw, server_hostname=host):
                return True
    except (OSError, ssl.SSLError):
        return False
