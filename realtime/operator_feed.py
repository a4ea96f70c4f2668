"""The operators' change feed: one unstored SSE channel saying which workers and jobs just changed.

It relays the audit log's ``CHANGES`` announcements (``audit.events``), and serves them at
GET /admin/live/changes to admin pages signed in with a session. The feed carries hints, not state: an admin page that hears its objects named re-reads them, and re-reads
everything on (re)connect, so an event lost to a full queue or a Redis outage costs nothing.
"""

import logging
import queue
import threading

from django.http import StreamingHttpResponse
from django_eventstream import eventstream as es_eventstream
from django_eventstream import send_event
from django_eventstream.views import Listener, stream
from redis.exceptions import RedisError

from audit.permissions import VIEW_AUDIT
from common.http import error_response
from common.permissions import may
from job_queue.permissions import VIEW_JOBS
from workers.permissions import VIEW_WORKERS

from .db import in_db_thread
from .event_requests import event_request_for
from .resume import requested_resume

logger = logging.getLogger(__name__)

CHANGES_CHANNEL = "operator-changes"
OPERATOR_FEED_PATH = "/admin/live/changes"
CHANGES = "changes"
# Targets named in one event; a larger batch (a sweep) says "many" and pages re-read all they show.
MAX_TARGETS = 100
# Events waiting for the background publisher (Redis deployments); beyond this they are dropped.
PUBLISH_QUEUE_MAX = 1000


class OperatorPrincipal:
    """Stands in for ``request.user`` on the change feed: a signed-in operator allowed to follow it."""

    is_authenticated = True
    is_anonymous = False

    def __init__(self, user_id):
        self.pk = f"user:{user_id}"


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


@in_db_thread
def _follower(request):
    """Return ``(user id, None)`` for a user who may follow the feed, else ``(None, error response args)``."""
    user = request.user  # the session lookup happens here, off the event loop
    if not user.is_authenticated:
        return None, ("not_authenticated", "sign in to the admin to follow changes", 401)
    if not (user.is_staff and any(may(user, p) for p in FOLLOW_PERMISSIONS)):
        return None, ("permission_denied", "only staff who may view workers, jobs or the audit log follow changes", 403)
    return user.pk, None


async def operator_changes_stream(request):
    """Stream ``changes`` events naming the workers and jobs that changed (401 signed out, 403 not allowed)."""
    if request.method != "GET":
        response = error_response("method_not_allowed", "use GET", 405)
        response["Allow"] = "GET"
        return response
    user_id, refusal = await _follower(request)
    if refusal:
        return error_response(*refusal)
    try:
        requested_resume(request)  # a malformed one is refused as on the worker stream
    except ValueError as exc:
        return error_response("invalid_last_event_id", str(exc), 400)
    request.user = OperatorPrincipal(user_id)
    # The feed is unstored: there is nothing to resume, so a well-formed resume hint (and the library's own
    # parameters) is ignored.
    event_request = event_request_for([CHANGES_CHANNEL], {}, request.user)
    listener = Listener()
    listener.user_id = request.user.pk
    listener.channels = event_request.channels
    response = StreamingHttpResponse(stream(event_request, listener), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response
