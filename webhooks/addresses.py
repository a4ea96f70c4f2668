"""Server-side request forgery: which addresses a webhook may reach, checked when it is set and again at each delivery.

By default a URL whose host resolves to a loopback, private, shared, link-local, multicast, unspecified or
reserved address is refused (every address the name resolves to must be public);
``SIMPLETUNER_WEBHOOK_ALLOW_PRIVATE=true`` allows them. A delivery connects to the very address checked
(``webhooks.sender``), so a name that resolves elsewhere a moment later (DNS rebinding) changes nothing.
"""

import ipaddress
import socket
from urllib.parse import urlsplit

from django.conf import settings

SCHEMES = {"http": 80, "https": 443}


class AddressRefused(Exception):
    """The URL cannot be used: its reason is the message (fit for a 400's field error and a delivery's record).

    ``transient``: the host did not resolve, which may pass (a delivery retries); else the address is refused.
    """

    def __init__(self, reason, *, transient=False):
        super().__init__(reason)
        self.transient = transient


def resolve(host, port):
    """Return the IP addresses ``host`` resolves to (a literal address: itself), in the resolver's order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


def allow_private():
    return settings.SIMPLETUNER["WEBHOOK_ALLOW_PRIVATE"]


def url_problem(url):
    """Return why ``url`` cannot be a webhook's address as written (scheme, host, port, credentials), or None."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"not a valid URL ({exc})"
    if parts.scheme not in SCHEMES:
        return "must be an http:// or https:// URL"
    if not parts.hostname:
        return "has no host"
    if parts.username is not None or parts.password is not None:
        return "must not hold credentials (user:password@); authenticate the receiver by the signature"
    if port == 0:
        return "has port 0"
    return None


def target(url):
    """Return ``(host, port, https)`` of a valid ``url``."""
    parts = urlsplit(url)
    return parts.hostname, parts.port or SCHEMES[parts.scheme], parts.scheme == "https"


def address_problem(address):
    """Return why a webhook may not connect to IP ``address`` by default (loopback, private, ...), or None."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for kind in ("loopback", "link_local", "multicast", "unspecified", "private", "reserved"):
        if getattr(ip, f"is_{kind}"):
            return f"{address} is a {kind.replace('_', '-')} address"
    if not ip.is_global:
        return f"{address} is not a public address"
    return None


def checked_addresses(url):
    """Resolve ``url``'s host and return its addresses, each one a webhook may connect to.

    Raise AddressRefused if the host does not resolve or, unless private addresses are allowed, if any address
    it resolves to is refused (one refused address is enough: a resolver may hand out either).
    """
    host, port, _https = target(url)
    try:
        addresses = resolve(host, port)
    except (OSError, UnicodeError) as exc:
        raise AddressRefused(f"host {host} does not resolve ({exc})", transient=True) from None
    if not addresses:
        raise AddressRefused(f"host {host} does not resolve", transient=True)
    if not allow_private():
        for address in addresses:
            problem = address_problem(address)
            if problem:
                raise AddressRefused(
                    f"host {host} resolves to {problem}; set SIMPLETUNER_WEBHOOK_ALLOW_PRIVATE=true to allow it"
                )
    return addresses
