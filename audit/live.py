"""GET /admin/live/changes: the operators' change feed as SSE, for admin pages signed in with a session.

Like the worker stream it is async, holds no thread and no DB connection while idle, and reads only
the one channel it is given (``?channel=`` is never honoured).
"""

from django.http import StreamingHttpResponse
from django_eventstream.eventrequest import EventRequest
from django_eventstream.views import Listener, stream

from simpletuner_site.api import error_response
from workers.events import in_db_thread

from .events import CHANGES_CHANNEL, OperatorPrincipal

# Any of these lets a staff user see what the feed names.
FOLLOW_PERMISSIONS = ("workers.view_worker", "queue.view_job", "audit.view_auditevent")


@in_db_thread
def _follower(request):
    """Return ``(user id, None)`` for a user who may follow the feed, else ``(None, error response args)``."""
    user = request.user  # the session lookup happens here, off the event loop
    if not user.is_authenticated:
        return None, ("not_authenticated", "sign in to the admin to follow changes", 401)
    if not (user.is_active and user.is_staff and any(user.has_perm(p) for p in FOLLOW_PERMISSIONS)):
        return None, ("permission_denied", "only staff who may view workers, jobs or the audit log follow changes", 403)
    return user.pk, None


async def operator_changes_stream(request):
    """Stream ``changes`` events naming the workers and jobs that changed (401 signed out, 403 not allowed)."""
    if request.method != "GET":
        return error_response("method_not_allowed", "use GET", 405)
    user_id, refusal = await _follower(request)
    if refusal:
        return error_response(*refusal)
    request.user = OperatorPrincipal(user_id)
    # The feed is unstored: there is nothing to resume, so resume hints (and channel picks) are ignored.
    request.META.pop("HTTP_LAST_EVENT_ID", None)
    request.GET = request.GET.copy()
    for hint in ("lastEventId", "es-meta", "channel", "channels"):
        request.GET.pop(hint, None)
    try:
        event_request = EventRequest(request, view_kwargs={"channels": [CHANGES_CHANNEL]})
    except EventRequest.Error as exc:
        return error_response("invalid_request", str(exc), 400)
    listener = Listener()
    listener.user_id = request.user.pk
    listener.channels = event_request.channels
    response = StreamingHttpResponse(stream(event_request, listener), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return response
