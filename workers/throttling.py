"""Failed authentication (tokens, and passwords at sign-in): counted, refused past the rate, audited in bounded form.

Every refused worker or operator token (the worker stream's too) is counted against its client
address in fixed windows of DRF's ``failed_auth`` rate (``SIMPLETUNER_FAILED_AUTH_RATE``, e.g.
``30/min``: 30 failures per minute). Past the rate, a refused token is answered 429 with
``Retry-After`` (the end of the window) instead of 401. The audit trail gets at most two rows per
address and window, whatever the flood: the window's first refusal (``auth.failed``, with the count
of the window before) and the one that crossed the rate (``auth.throttled``), recording the
address and the token's display prefix, never the token.

Only failures touch the counters: a valid token is looked up exactly as before, with no cache access,
so a throttled address still gets its valid tokens served (a misconfigured agent behind a NAT does
not lock its neighbours out). The counters live in the cache: Redis when ``REDIS_URL`` is set,
shared by every server process; the process's memory otherwise, or while Redis is unreachable.

Failed sign-ins with a password (the admin's and the API's login pages, ``simpletuner_site.login``)
use the same counters at their own rate (``failed_login``, ``SIMPLETUNER_FAILED_LOGIN_RATE``), one per
address and one per username: once either has used up the window, a sign-in is refused before its
password is hashed (``login_refused``), the right password too, until the window ends. They are audited
in the same bounded form (``auth.login_failed``, ``auth.login_throttled``), naming the username.

What a worker provokes with its own valid token is bounded alike, per worker: refusals (reports and
heartbeats for jobs or attempts it does not hold, claims to be another worker; ``worker_refused``) and
registrations (``worker_registration_throttled``), each counted at the ``failed_auth`` rate, the window's
first refusal and the crossing of the rate (``worker.throttled``) audited.
"""

import hashlib
import ipaddress
import logging
import math
import time

from django.core.cache import cache
from django.core.cache.backends.locmem import LocMemCache
from rest_framework.settings import api_settings
from rest_framework.throttling import SimpleRateThrottle

from audit import actions
from common.remote import client_ip

from .accounts import login_failure_audit
from .models import TokenKind, token_display_prefix
from .services import auth_failure_audit, worker_throttled_audit

logger = logging.getLogger(__name__)

SCOPE = "failed_auth"
UPLOAD_TOKEN = "upload"  # an attempt's upload token (job_queue.api.upload_views): not a Token row, counted alike
KINDS = {TokenKind.WORKER: "worker", TokenKind.API: "operator", UPLOAD_TOKEN: "upload"}

# Where the counters go while the shared cache (Redis) cannot be reached: this process's memory, for
# RETRY_SHARED_AFTER_S before the shared cache is tried again.
_fallback = LocMemCache("simpletuner-failed-auth", {})
RETRY_SHARED_AFTER_S = 30.0
_shared_down_until = 0.0


def address_key(address):
    """Return what the rate applies to for ``address``: the address, or its /64 network for IPv6."""
    if not address:
        return "unknown"
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return "unknown"
    if ip.version == 6:
        if ip.ipv4_mapped:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False).network_address) + "/64"
    return str(ip)


def _cache_call(method, *args):
    """Call ``method`` on the shared cache, or on this process's memory while the shared one fails."""
    global _shared_down_until
    if time.monotonic() >= _shared_down_until:
        try:
            return getattr(cache, method)(*args)
        except ValueError:  # incr of a missing key: the caller's to handle
            raise
        except Exception as exc:  # the backend's own errors (redis-py's), whatever it is
            logger.warning("failed-authentication counters: cache unreachable (%s); counting in this process", exc)
            _shared_down_until = time.monotonic() + RETRY_SHARED_AFTER_S
    return getattr(_fallback, method)(*args)


def _increment(key, timeout):
    try:
        return _cache_call("incr", key)
    except ValueError:  # the first failure of this window
        if _cache_call("add", key, 1, timeout):
            return 1
        return _cache_call("incr", key)


class FailedAuthenticationThrottle(SimpleRateThrottle):
    """DRF's rate throttle over failed authentications only, in fixed windows: one atomic counter per address."""

    scope = SCOPE
    cache_format = "failed-auth:%(ident)s:%(window)d"

    def __init__(self):
        self.rate = self.get_rate()
        self.num_requests, self.duration = self.parse_rate(self.rate)

    def get_rate(self):
        return api_settings.DEFAULT_THROTTLE_RATES[self.scope]  # read now: settings may change (tests)

    def key(self, ident, window):
        return self.cache_format % {"ident": ident, "window": window}

    def for_ident(self, ident):
        """Aim this throttle at ``ident``'s counter of the current window; return it."""
        self.now = self.timer()
        self.ident = ident
        self.window = int(self.now // self.duration)
        return self

    def count_failure(self):
        """Count one failure against the ident; return False once past the rate."""
        self.failures = _increment(self.key(self.ident, self.window), self.duration * 2)
        return self.failures <= self.num_requests

    def failures_so_far(self):
        """Return the failures counted against the ident in the current window."""
        return _cache_call("get", self.key(self.ident, self.window), 0)

    def allow_request(self, request, view=None):
        """Count one failed authentication from ``request``'s address; return False once past the rate."""
        return self.for_ident(address_key(client_ip(request))).count_failure()

    def wait(self):
        """Return the seconds until the address's window ends."""
        return max(1, math.ceil((self.window + 1) * self.duration - self.now))

    def failures_in_previous_window(self):
        return _cache_call("get", self.key(self.ident, self.window - 1), 0)


def authentication_failed(request, *, kind, presented, reason):
    """Count a refused token ``presented`` by ``request`` and audit it, bounded; return the seconds the
    address must wait when it is past the rate (answer 429), else None (answer 401).
    """
    throttle = FailedAuthenticationThrottle()
    allowed = throttle.allow_request(request)
    address = client_ip(request)
    seen = {"token_prefix": token_display_prefix(presented), "path": _printable(request.path, 200)}
    if throttle.failures == 1:
        auth_failure_audit(
            action=actions.AUTH_FAILED,
            kind=KINDS[kind],
            address=address,
            details={
                **seen,
                "reason": reason,
                "window_seconds": throttle.duration,
                "failures_in_previous_window": throttle.failures_in_previous_window(),
            },
        )
    if allowed:
        return None
    wait = throttle.wait()
    if throttle.failures == throttle.num_requests + 1:
        logger.warning(
            "failed authentication from %s throttled: %d failures within %d s", address, throttle.failures, throttle.duration
        )
        auth_failure_audit(
            action=actions.AUTH_THROTTLED,
            kind=KINDS[kind],
            address=address,
            details={**seen, "failures": throttle.failures, "window_seconds": throttle.duration, "retry_after": wait},
        )
    return wait


# --- sign-ins with a password ----------------------------------------------------------------------

LOGIN_SCOPE = "failed_login"
USERNAME_RECORDED = 150  # characters of a claimed username kept in an audit row (Django's own username limit)


class FailedLoginThrottle(FailedAuthenticationThrottle):
    """The same fixed-window counters, for failed sign-ins, at DRF's ``failed_login`` rate."""

    scope = LOGIN_SCOPE


def _login_throttles(request, username):
    """Return the throttles a sign-in as ``username`` from ``request`` counts against: its address's and the username's."""
    digest = hashlib.sha256(username.encode("utf-8", "backslashreplace")).hexdigest()[:32]
    return (
        FailedLoginThrottle().for_ident(f"login:{address_key(client_ip(request))}"),
        FailedLoginThrottle().for_ident(f"login-user:{digest}"),
    )


def login_refused(request, username):
    """Return the seconds to wait when ``request``'s address or ``username`` has used up its failed sign-ins in the
    current window, else None. Called before the password is checked, so a refused sign-in costs no hashing;
    it is counted (the next window's first row says how many there were) but writes no row.
    """
    waits = []
    for throttle in _login_throttles(request, username):
        if throttle.failures_so_far() >= throttle.num_requests:
            throttle.count_failure()
            waits.append(throttle.wait())
    return max(waits) if waits else None


def login_failed(request, username):
    """Count a failed sign-in as ``username`` from ``request`` against its address and the username; audit it, bounded.

    Rows: the address's first failure of the window (``auth.login_failed``, with the count of the window
    before), and the failure that brings the address or the username to the rate (``auth.login_throttled``),
    after which ``login_refused`` refuses them until the window ends. The username is recorded, the
    password never.
    """
    by_address, by_username = _login_throttles(request, username)
    for throttle in (by_address, by_username):
        throttle.count_failure()
    address = client_ip(request)
    seen = {"username": _printable(username, USERNAME_RECORDED), "path": _printable(request.path, 200)}
    if by_address.failures == 1:
        login_failure_audit(
            action=actions.AUTH_LOGIN_FAILED,
            address=address,
            details={
                **seen,
                "window_seconds": by_address.duration,
                "failures_in_previous_window": by_address.failures_in_previous_window(),
            },
        )
    for per, throttle in (("address", by_address), ("username", by_username)):
        if throttle.failures == throttle.num_requests:
            logger.warning(
                "failed sign-ins throttled for %s (%s): %d failures within %d s",
                seen["username"] if per == "username" else address,
                per,
                throttle.failures,
                throttle.duration,
            )
            login_failure_audit(
                action=actions.AUTH_LOGIN_THROTTLED,
                address=address,
                details={**seen, "per": per, "failures": throttle.failures, "window_seconds": throttle.duration,
                         "retry_after": throttle.wait()},
            )  # fmt: skip


# --- what a worker provokes with its own valid token -------------------------------------------------


def _worker_throttle(worker_id, what):
    """The failed-authentication counters and rate, aimed at worker ``worker_id``'s ``what`` in this window."""
    return FailedAuthenticationThrottle().for_ident(f"worker-{what}:{worker_id}")


def worker_refused(*, worker_id, address, record=None):
    """Count a refusal that worker ``worker_id`` provoked with its own valid token (a report or heartbeat naming a
    job or attempt it does not hold, a claim to be another worker) against that worker, in the windows and at
    the rate of failed authentication; return the seconds to wait once it is past the rate, else None.

    Audited in the same bounded form: ``record(previous)``, if given, writes the window's first refusal's own
    row (``previous``: the refusals of the window before); the refusal that crosses the rate writes
    ``worker.throttled``; the others write nothing. The caller's answer may stay what the protocol says
    (a stale report is still a 409 that makes the agent stop its copy): only the rows are bounded then.
    """
    throttle = _worker_throttle(worker_id, "refusals")
    allowed = throttle.count_failure()
    if throttle.failures == 1 and record is not None:
        record(throttle.failures_in_previous_window())
    return _worker_past_rate(throttle, allowed, worker_id=worker_id, address=address, what="refusals")


def worker_registration_throttled(*, worker_id, address):
    """Count a registration of worker ``worker_id`` (each one changes its state and writes its rows) at the rate of
    failed authentication; return the seconds to wait once past it (answer 429 and register nothing), else None.
    A register/disconnect loop thus writes a bounded number of rows per window."""
    throttle = _worker_throttle(worker_id, "registrations")
    allowed = throttle.count_failure()
    return _worker_past_rate(throttle, allowed, worker_id=worker_id, address=address, what="registrations")


def _worker_past_rate(throttle, allowed, *, worker_id, address, what):
    if allowed:
        return None
    wait = throttle.wait()
    if throttle.failures == throttle.num_requests + 1:
        logger.warning("worker %s throttled: %d %s within %d s", worker_id, throttle.failures, what, throttle.duration)
        worker_throttled_audit(
            worker_id=worker_id,
            address=address,
            details={"what": what, "count": throttle.failures, "window_seconds": throttle.duration, "retry_after": wait},
        )
    return wait


def _printable(text, limit):
    return "".join(c if c.isprintable() else "?" for c in (text or "")[:limit])
