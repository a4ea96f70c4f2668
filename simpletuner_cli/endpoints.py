"""Where the server listens and how clients reach it: host and port arguments, endpoints, URLs."""

import argparse
import ipaddress
import socket
from urllib.parse import unquote, urlsplit, urlunsplit

from cryptography import x509

MASK = "****"
_SECRET_QUERY_KEYS = ("password", "secret", "token")


# --- argument types -------------------------------------------------------------------------
def parse_port(raw):
    """Return ``raw`` as a port number; raise ArgumentTypeError unless it is one (1-65535)."""
    try:
        port = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {raw!r}") from None
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be 1-65535, got {port}")
    return port


def parse_host(raw):
    """Return ``raw`` as an address or host name, without IPv6 brackets; raise ArgumentTypeError if neither."""
    host = raw.strip()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() or c in "/[]" for c in host):
        raise argparse.ArgumentTypeError(f"not an address or host name: {raw!r}")
    return host


def host_ip(host):
    """Return ``host`` as an IP address object, or None when it is a host name."""
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


# --- URLs and endpoints ---------------------------------------------------------------------
def mask_url(url):
    """Return ``url`` with its password, and any password/secret/token query value, replaced by ****."""
    parts = urlsplit(url)
    userinfo, at, hostport = parts.netloc.rpartition("@")
    netloc = parts.netloc
    if at and ":" in userinfo:
        netloc = f"{userinfo.split(':', 1)[0]}:{MASK}@{hostport}"
    query = []
    for pair in parts.query.split("&") if parts.query else []:
        key, eq, value = pair.partition("=")
        if eq and any(word in unquote(key).lower() for word in _SECRET_QUERY_KEYS):
            value = MASK
        query.append(f"{key}{eq}{value}")
    return urlunsplit(parts._replace(netloc=netloc, query="&".join(query)))


def _escape_endpoint_value(value):
    return str(value).replace("\\", "\\\\").replace(":", "\\:").replace("=", "\\=")


# Connections the kernel queues before daphne accepts them. Twisted's default, 50, overflows when a fleet
# (re)connects at once, and each dropped SYN costs its client a 1 s retransmission.
LISTEN_BACKLOG = 1024


def endpoint_string(host, port, *, certfile=None, keyfile=None):
    """Return the Twisted endpoint description daphne listens on: tcp, or ssl when given a cert and key."""
    interface = _escape_endpoint_value(host)
    if certfile is None:
        return f"tcp:port={port}:interface={interface}:backlog={LISTEN_BACKLOG}"
    return (
        f"ssl:port={port}:interface={interface}:backlog={LISTEN_BACKLOG}"
        f":privateKey={_escape_endpoint_value(keyfile)}:certKey={_escape_endpoint_value(certfile)}"
    )


def listen_address(host, port):
    """Return where the server listens, as the banner shows it: ``host:port``, noting a wildcard address."""
    listen = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    ip = host_ip(host)
    if ip is not None and ip.is_unspecified:
        listen += ", every interface"
    return listen


def public_url(scheme, host, port):
    """Return the URL clients use: the machine's host name when listening on every interface."""
    ip = host_ip(host)
    if ip is not None and ip.is_unspecified:
        host = socket.gethostname()
    elif ip is not None and ip.version == 6:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def _url(scheme, host, port):
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def loopback_host(host):
    """Return the address the built-in local worker dials to reach a server listening on ``host``.

    A wildcard address listens on loopback too; a specific address or host name listens only there.
    """
    ip = host_ip(host)
    if ip is None:
        return "127.0.0.1" if host.lower() == "localhost" else host  # Twisted binds a host name over IPv4
    if ip.is_unspecified:
        return "127.0.0.1" if ip.version == 4 else "::1"
    return host


def _cert_names(cert):
    """Return (IP addresses, DNS names) of ``cert``'s subject alternative names."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set(), []
    return set(san.get_values_for_type(x509.IPAddress)), san.get_values_for_type(x509.DNSName)


def local_worker_endpoint(host, port, *, cert=None, certfile=None):
    """Return ``(url, ca_cert)``: how the built-in local worker reaches a server listening on ``host``.

    Without ``cert`` the URL is plain HTTP to the loopback address. Over TLS it names a host the
    certificate covers: that address if it does, else ``localhost`` (for a loopback address), else the
    certificate's first DNS name. ``ca_cert`` is ``certfile`` when the certificate is self-signed (the
    agent trusts exactly it), else None (the agent uses the system's trust store).
    """
    address = loopback_host(host)
    if cert is None:
        return _url("http", address, port), None
    ips, dns_names = _cert_names(cert)
    ip = host_ip(address)
    if ip in ips if ip is not None else address.lower() in {name.lower() for name in dns_names}:
        name = address
    elif ip is not None and ip.is_loopback and "localhost" in dns_names:
        name = "localhost"
    else:
        name = next((dns for dns in dns_names if not dns.startswith("*")), address)
    ca_cert = certfile if cert.issuer == cert.subject else None
    return _url("https", name, port), ca_cert
