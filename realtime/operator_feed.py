"""The operators' change feed: one unstored SSE channel saying which workers and jobs just changed.

It relays the audit log's ``CHANGES`` announcements (``audit.events``), and serves them at
GET /admin/live/changes to admin pages signed in with a session, and to API clients (the `simpletuner jobs`
command line) with an operator API token (``Authorization: Bearer``). The feed carries hints, not state: an admin page that hears its objects named re-reads them, and re-reads
everything on (re)connect, so an event lost to a full queue or a Redis outage costs nothing.

A feed lives only as long as the session that opened it would still open it: signed in, not expired,
its user active, staff and allowed to follow (with a token: the token active, its user active and allowed). An account change that may take that away announces its
users (``workers.accounts.ACCESS_CHANGED``); every process then re-checks those users' open feeds (a
``recheck`` control message, sent like a worker stream's revocation) and ends each that fails, with a
``stream-error``. Every ``RECHECK_INTERVAL_S`` each process re-checks all its feeds, for what a push
missed (Redis down, a session expired, a queryset update).
"""

import asyncio
import hashlib
import logging
import math
import queue
import threading
from importlib import import_module

from django.conf import settings
from django.contrib.auth import BACKEND_SESSION_KEY, HASH_SESSION_KEY, SESSION_KEY, get_user_model, load_backend
from django.http import StreamingHttpResponse
from django.utils.crypto import constant_time_compare
from django_eventstream import eventstream as es_eventstream
from django_eventstream import send_event
from django_eventstream import views as es_views
from django_eventstream.utils import sse_encode_error
from django_eventstream.views import Listener, stream
from redis.exceptions import RedisError
from rest_framework.exceptions import AuthenticationFailed, Throttled

from audit.permissions import VIEW_AUDIT
from common.http import error_response
from common.permissions import may
from job_queue.permissions import VIEW_JOBS
from workers.authentication import BearerTokenAuthentication
from workers.models import TokenKind
from workers.services import token_active
from workers.permissions import VIEW_WORKERS

from .db import in_db_thread
from .event_requests import event_request_for
from .publish import CONTROL_PREFIX, send
from .resume import requested_resume

logger = logging.getLogger(__name__)

CHANGES_CHANNEL = "operator-changes"
OPERATOR_FEED_PATH = "/admin/live/changes"
CHANGES = "changes"
# Targets named in one event; a larger batch (a sweep) says "many" and pages re-read all they show.
MAX_TARGETS = 100
# Events waiting for the background publisher (Redis deployments); beyond this they are dropped.
PUBLISH_QUEUE_MAX = 1000
# The control message asking every process to re-check named users' feeds (payload: users, their ids).
RECHECK = "recheck"
# How often each process re-checks all its open feeds, for what a push missed.
RECHECK_INTERVAL_S = 10.0
REVOKED = "signed out, or no longer allowed to follow changes"


class OperatorPrincipal:
    """Stands in for ``request.user`` on the change feed: an operator allowed to follow it, by the session (or the
    API token, ``token``) that opened the feed. ``pk`` names the session (a digest) or the token, so a revocation
    ends that session's (token's) feeds only."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, user_id, session_key, token=None):
        self.user_id = user_id
        self.session_key = session_key
        self.token_id, self.token_digest = (token.pk, token.digest) if token is not None else (None, None)
        if token is not None:
            self.pk = f"token:{token.pk}"
        else:
            self.pk = "session:" + hashlib.sha256(session_key.encode()).hexdigest()[:32]
        self.revoked = False
        self.revoked_reason = ""
        self.revoked_code = ""


class FeedListener(Listener):
    """The library's listener for one feed, with the principal a revocation marks (``WorkerListenerManager.revoke``)."""

    def __init__(self, principal, channels):
        super().__init__()
        self.principal = principal
        self.user_id = principal.pk
        self.channels = channels


def changes_payload(targets):
    """Return the ``changes`` event data for ``(target_type, target_id)`` pairs (deduplicated, capped)."""
    unique = sorted(set(targets))
    if len(unique) > MAX_TARGETS:
        return {"type": CHANGES, "many": True, "targets": []}
    return {"type": CHANGES, "many": False, "targets": [{"type": kind, "id": pk} for kind, pk in unique]}


def _send_now(data):
    try:
        send_event(CHANGES_CHANNEL, CHANGES, data)
    except RedisError as exc:
        logger.warning("operator change feed event dropped, Redis is unreachable (%s): admin pages re-read within 10 s", exc)


class _BackgroundPublisher:
    """Publishes feed events from one daemon thread, merging what queued up, dropping beyond a bound.

    With Redis, a publish is network I/O; the transaction that announced a change must not wait on it
    (a hung Redis would add its socket timeout to every audited request).
    """

    def __init__(self):
        self.queue = queue.Queue(maxsize=PUBLISH_QUEUE_MAX)
        self.lock = threading.Lock()
        self.thread = None

    def submit(self, data):
        with self.lock:
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._run, name="operator-feed-publisher", daemon=True)
                self.thread.start()
        try:
            self.queue.put_nowait(data)
        except queue.Full:
            logger.debug("operator change feed event dropped: %d waiting to be published", PUBLISH_QUEUE_MAX)

    def _run(self):
        while True:
            batch = [self.queue.get()]
            while True:
                try:
                    batch.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            if any(data["many"] for data in batch):
                _send_now({"type": CHANGES, "many": True, "targets": []})
            else:
                _send_now(changes_payload((t["type"], t["id"]) for data in batch for t in data["targets"]))


_publisher = _BackgroundPublisher()


def publish(data):
    """Send a ``changes`` event: at once when events stay in this process (no Redis), else in the background."""
    if es_eventstream.redis_client is None:
        _send_now(data)
    else:
        _publisher.submit(data)


def on_changes(*, targets):
    """Subscriber of ``audit.events.CHANGES``: announce ``targets`` on the feed."""
    publish(changes_payload(targets))


# --- GET /admin/live/changes ----------------------------------------------------------------------

# Any of these lets a staff user see what the feed names.
FOLLOW_PERMISSIONS = (VIEW_WORKERS, VIEW_JOBS, VIEW_AUDIT)


def follow_refusal(user, *, by_token=False):
    """Return None when ``user`` may follow the feed, else ``error_response``'s ``(code, detail, status)``.

    With a session (the admin's pages) the user must be staff; with an API token (``by_token``), as everywhere in
    the API, the permission alone counts."""
    if not user.is_authenticated:
        return ("not_authenticated", "sign in to the admin to follow changes", 401)
    if not ((by_token or user.is_staff) and any(may(user, p) for p in FOLLOW_PERMISSIONS)):
        who = "users" if by_token else "staff"
        return ("permission_denied", f"only {who} who may view workers, jobs or the audit log follow changes", 403)
    return None


@in_db_thread
def _follower(request):
    """Return ``(user id, session key, API token, None)`` for a user who may follow the feed, else ``(None, None, None,
    error response args)``. An ``Authorization: Bearer`` token is checked (and a refused one counted) as the API
    checks it; without one, the session."""
    if request.headers.get("Authorization"):
        try:
            authenticated = BearerTokenAuthentication().authenticate(request)
        except Throttled as exc:
            return None, None, None, ("throttled", str(exc.detail), 429, exc.wait)
        except AuthenticationFailed as exc:
            return None, None, None, ("not_authenticated", str(exc.detail), 401)
        if authenticated is None:  # another scheme than Bearer
            return None, None, None, ("not_authenticated", "send Authorization: Bearer <API token>", 401)
        user, token = authenticated
        refusal = follow_refusal(user, by_token=True)
        return (None, None, None, refusal) if refusal else (user.pk, "", token, None)
    user = request.user  # the session lookup happens here, off the event loop
    refusal = follow_refusal(user)
    if refusal:
        return None, None, None, refusal
    return user.pk, request.session.session_key or "", None, None


def token_user(digest):
    """Return the user the API token whose hash is ``digest`` signs in now (the token active, its user active), else
    None."""
    token = token_active(kind=TokenKind.API, digest=digest)
    return token.user if token is not None and token.user is not None and token.user.is_active else None


def session_user(session_key):
    """Return the user that session ``session_key`` signs in now, as Django's ``auth.get_user`` would, else None.

    Read only: unlike ``get_user``, it never flushes or re-keys the session (it is not this request's).
    None for a session gone or expired, a user deleted or inactive, or a session from before a new password.
    """
    store = import_module(settings.SESSION_ENGINE).SessionStore(session_key)
    try:
        user_id = get_user_model()._meta.pk.to_python(store[SESSION_KEY])
        backend_path = store[BACKEND_SESSION_KEY]
    except KeyError:
        return None
    if backend_path not in settings.AUTHENTICATION_BACKENDS:
        return None
    user = load_backend(backend_path).get_user(user_id)
    if user is None:
        return None
    presented = store.get(HASH_SESSION_KEY) or ""
    valid = (user.get_session_auth_hash(), *user.get_session_auth_fallback_hash())
    return user if presented and any(constant_time_compare(presented, h) for h in valid) else None


def _feed_listeners(user_ids=None):
    """Return this process's open feed listeners not yet revoked (of ``user_ids``' users only, when given)."""
    return [
        listener
        for listener in es_views.get_listener_manager().listeners()
        if isinstance(getattr(listener, "principal", None), OperatorPrincipal)
        and not listener.principal.revoked
        and (user_ids is None or listener.principal.user_id in user_ids)
    ]


def close_unfollowable_feeds(user_ids=None):
    """End this process's feeds (of ``user_ids``' users, or all) whose session would not open the feed now; return
    how many sessions' feeds ended. Sync: reads the database (sessions, users, permissions)."""
    manager = es_views.get_listener_manager()
    principals = {listener.principal.pk: listener.principal for listener in _feed_listeners(user_ids)}
    closed = 0
    for pk, principal in principals.items():
        by_token = principal.token_id is not None
        user = token_user(principal.token_digest) if by_token else session_user(principal.session_key)
        if user is None or user.pk != principal.user_id or follow_refusal(user, by_token=by_token) is not None:
            manager.revoke(CHANGES_CHANNEL, {pk}, REVOKED, code="access_revoked")
            closed += 1
    return closed


async def _recheck(user_ids):
    try:
        await in_db_thread(close_unfollowable_feeds)(user_ids)
    except Exception:
        logger.exception("could not re-check the operator feeds of users %s", sorted(user_ids) if user_ids else "(all)")


_background = set()  # the re-checks under way (the loop keeps only weak references to its tasks)
_periodic = {}  # event loop -> its periodic re-check task


def _start(loop, name, function, *args):
    task = loop.create_task(function(*args), name=name)
    _background.add(task)
    task.add_done_callback(_background.discard)
    return task


def recheck_soon(user_ids):
    """Re-check, off the event loop, this process's feeds of ``user_ids``' users (``close_unfollowable_feeds``).

    Called from any thread: on the ``recheck`` control message (``WorkerListenerManager.add_to_queues``).
    """
    user_ids = set(user_ids)
    for loop in {listener.loop for listener in _feed_listeners(user_ids) if listener.loop is not None}:
        try:
            loop.call_soon_threadsafe(_start, loop, "operator-feed-recheck", _recheck, user_ids)
        except RuntimeError:  # its loop closed meanwhile: so did its streams
            continue


def _recheck_periodically_here():
    """Run the periodic re-check of this loop's feeds unless it runs already; it ends once the loop has none."""
    loop = asyncio.get_running_loop()
    task = _periodic.get(loop)
    if task is None or task.done():
        _periodic[loop] = task = _start(loop, "operator-feed-periodic-recheck", _recheck_periodically, loop)
        task.add_done_callback(lambda done: _periodic.pop(loop, None) if _periodic.get(loop) is done else None)


async def _recheck_periodically(loop):
    while True:
        await asyncio.sleep(RECHECK_INTERVAL_S)
        if not any(listener.loop is loop for listener in _feed_listeners()):
            return
        await _recheck(None)


def on_access_changed(*, user_ids):
    """Subscriber of ``workers.accounts.ACCESS_CHANGED``: ask every process to re-check these users' feeds."""
    send(CONTROL_PREFIX + CHANGES_CHANNEL, RECHECK, {"users": list(user_ids)})


async def operator_changes_stream(request):
    """Stream ``changes`` events naming the workers and jobs that changed (401 signed out or a refused token, 403 not
    allowed, 429 past the failed-authentication rate)."""
    if request.method != "GET":
        response = error_response("method_not_allowed", "use GET", 405)
        response["Allow"] = "GET"
        return response
    user_id, session_key, token, refusal = await _follower(request)
    if refusal:
        response = error_response(*refusal[:3])
        if len(refusal) > 3 and refusal[3]:
            response["Retry-After"] = str(math.ceil(refusal[3]))
        return response
    try:
        requested_resume(request)  # a malformed one is refused as on the worker stream
    except ValueError as exc:
        return error_response("invalid_last_event_id", str(exc), 400)
    principal = request.user = OperatorPrincipal(user_id, session_key, token)
    # The feed is unstored: there is nothing to resume, so a well-formed resume hint (and the library's own
    # parameters) is ignored.
    event_request = event_request_for([CHANGES_CHANNEL], {}, principal)
    listener = FeedListener(principal, event_request.channels)

    async def body():
        rechecking = False
        async for chunk in stream(event_request, listener):
            if principal.revoked:  # the library's own error names the channel; say why instead
                yield sse_encode_error("forbidden", principal.revoked_reason)
                return
            if not rechecking:  # the listener is registered once the library yields
                rechecking = True
                _recheck_periodically_here()
            yield chunk

    response = StreamingHttpResponse(body(), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response
