"""Reading the settings' environment: the environment file named by SIMPLETUNER_ENV_FILE, the variables (each reader
returns the default for an unset or empty variable and raises ImproperlyConfigured, naming the variable, for a value
it cannot take), and the Host names a server answers to by default, which depend on the machine and the variables
``simpletuner server`` sets."""

import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse

from django.core.exceptions import ImproperlyConfigured

ENV_FILE_VARIABLE = "SIMPLETUNER_ENV_FILE"


def load_env_file():
    """Add the variables of the file named by SIMPLETUNER_ENV_FILE to ``os.environ``; return its path (None if unset).

    A variable already in the process environment wins over the file's: ``DATABASE_URL=... manage.py ...`` overrides
    the file for one command. The syntax is python-dotenv's (``KEY=value``, ``#`` comments, single or double quotes,
    an optional ``export``), without ``${VAR}`` expansion, as systemd's EnvironmentFile= reads it. Raise
    ImproperlyConfigured, naming the file, if it cannot be read or a line is not ``KEY=value``: a named file is never
    skipped in silence, which would leave the embedded SQLite database in its place.
    """
    from dotenv.parser import parse_stream

    named = os.environ.get(ENV_FILE_VARIABLE, "").strip()
    if not named:
        return None
    path = Path(named).expanduser().absolute()
    try:
        with path.open(encoding="utf-8") as stream:
            bindings = list(parse_stream(stream))
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ImproperlyConfigured(f"{ENV_FILE_VARIABLE}={named}: cannot read the environment file: {reason}") from None
    values = {}
    for binding in bindings:
        line = binding.original.line
        if binding.error:
            raise ImproperlyConfigured(f"{path}, line {line}: not KEY=value: {binding.original.string.strip()!r}")
        if binding.key is None:  # a blank line or a comment
            continue
        if binding.value is None:
            raise ImproperlyConfigured(f"{path}, line {line}: {binding.key} has no value (write {binding.key}= for an empty one)")
        values[binding.key] = binding.value
    for key, value in values.items():
        os.environ.setdefault(key, value)
    return path


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


def env_port_range(name, default):
    """Return ``(first, last)`` of a port range written ``first-last`` (1 to 65535, first <= last)."""
    raw = os.environ.get(name) or default
    first, dash, last = raw.strip().partition("-")
    try:
        low, high = int(first), int(last if dash else first)
    except ValueError:
        raise ImproperlyConfigured(f"{name} must look like 29500-29999, got {raw!r}") from None
    if not 1 <= low <= high <= 65535:
        raise ImproperlyConfigured(f"{name} must be ports from 1 to 65535, the first no greater than the last, got {raw!r}")
    return low, high


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
