"""The library's EventRequest, built from values the orchestrator chose rather than from the HTTP request."""

from django_eventstream.eventrequest import EventRequest


def event_request_for(channels, channel_last_ids, user):
    """The library's EventRequest for ``channels``, built from these values rather than from the HTTP
    request: the query string never reaches the library's signed-metadata (``es-meta``), GRIP recovery
    (``recover``), paging (``link``) or channel-choice (``channel``) paths, so those parameters are
    ignored, never a 500, and a stream reads only the channels its credentials chose."""
    event_request = EventRequest()
    event_request.channels = list(channels)
    event_request.channel_last_ids = dict(channel_last_ids)
    event_request.is_next = False
    event_request.is_recover = False
    event_request.user = user
    return event_request
