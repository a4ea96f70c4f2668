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
def _follower_id(request):
    user = request.user  # the session lookup happens here, off the event loop
    if not (user.is_authenticated and user.is_active and user.is_staff):
        return None
    if not any(user.has_perm(permission) for permission in FOLLOW_PERMISSIONS):
        return None
    return user.pk


async def operator_changes_stream(request):
    """Stream ``changes`` events naming the workers and jobs that changed (403 unless signed-in staff)."""
    if request.method != "GET":
        return error_response("method_not_allowed", "use GET", 405)
    user_id = await _follower_id(request)
    if user_id is None:
        return error_response("permission_denied", "sign in to the admin as staff to follow changes", 403)
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
