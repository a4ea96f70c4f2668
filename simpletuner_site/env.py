"""Reading the settings' environment variables (each reader returns the default for an unset or empty variable and
raises ImproperlyConfigured, naming the variable, for a value it cannot take), and the Host names a server answers
to by default, which depend on the machine and the variables ``simpletuner server`` sets."""

import os
import re
import socket
from urllib.parse import urlparse

from django.core.exceptions import ImproperlyConfigured


def env_bool(name, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in {"1", "true", "yes", "on"}:
        return True
    if value in {"0", "false", "no", "off"}:
        return False
    raise ImproperlyConfigured(f"{name} must be true or false, got {raw!r}")


def env_seconds(name, default):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return float(default)
    try:
        value = float(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be a number of seconds, got {raw!r}") from None
    if value <= 0:
        raise ImproperlyConfigured(f"{name} must be positive, got {raw!r}")
    return value


def env_int(name, default, minimum=0, maximum=None):
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must be an integer, got {raw!r}") from None
    if value < minimum:
        raise ImproperlyConfigured(f"{name} must be >= {minimum}, got {raw!r}")
    if maximum is not None and value > maximum:
        raise ImproperlyConfigured(f"{name} must be <= {maximum}, got {raw!r}")
    return value


RATE = re.compile(r"^([1-9][0-9]*)/(s|sec|second|m|min|minute|h|hour|d|day)$")


def env_rate(name, default):
    """Return a DRF throttle rate (``30/min``: a count per second, minute, hour or day) from ``name``."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if not RATE.match(value):
        raise ImproperlyConfigured(f"{name} must look like 30/min (a count per s, min, hour or day), got {raw!r}")
    return value


def env_choice(name, default, choices):
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ImproperlyConfigured(f"{name} must be one of {', '.join(choices)}, got {raw!r}")
    return value


# The Host values a server answers to outside production mode when DJANGO_ALLOWED_HOSTS is not set: the
# loopback names (Django's development default), the addresses in SIMPLETUNER_SERVER_HOSTS (set by
# `simpletuner server`: its --host, every local interface address for 0.0.0.0 or ::, and the name its
# built-in local worker dials), SIMPLETUNER_PUBLIC_URL's host, and this machine's names (host name, fully
# qualified name) and the addresses its host name resolves to. Any other Host gets 400, so a page whose
# DNS name is rebound to this machine cannot reach its API. DJANGO_ALLOWED_HOSTS, when not empty, is the list.
LOOPBACK_ALLOWED_HOSTS = [".localhost", "127.0.0.1", "[::1]"]


def _allowed_host(name):
    """Return ``name`` as an ALLOWED_HOSTS entry: lower case; an IPv6 address bracketed, without its zone."""
    name = name.strip().strip("[]").split("%", 1)[0].lower()
    return f"[{name}]" if ":" in name else name


def _wildcard(host):
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_unspecified
    except ValueError:
        return False


def default_allowed_hosts():
    """Return ALLOWED_HOSTS outside production mode without DJANGO_ALLOWED_HOSTS (see above)."""
    served = [h for h in os.environ.get("SIMPLETUNER_SERVER_HOSTS", "").split(",") if h.strip()]
    hostname = socket.gethostname()
    names = {*served, hostname, socket.getfqdn()}
    try:
        names |= {info[4][0] for info in socket.getaddrinfo(hostname, None)}
    except OSError:  # a host name that does not resolve: the name alone
        pass
    if any(_wildcard(h) for h in served):
        import psutil

        families = (socket.AF_INET, socket.AF_INET6)
        names |= {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family in families}
    try:
        names.add(urlparse(os.environ.get("SIMPLETUNER_PUBLIC_URL", "")).hostname or "")
    except ValueError:  # not a URL: refused below, with the reason
        pass
    extra = {_allowed_host(n) for n in names if n.strip()} - {"localhost", *LOOPBACK_ALLOWED_HOSTS}  # .localhost has it
    return LOOPBACK_ALLOWED_HOSTS + sorted(extra)
