"""Read-only audit log API for users with the audit view permission (audit.view_auditevent)."""

import re
from datetime import timezone as dt_timezone

from django.utils.dateparse import parse_datetime
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework.generics import ListAPIView

from common.http import error_responses, query_param, query_parameter
from common.errors import InvalidInput
from common.serializers import ModelSerializer

from ..models import AuditEvent
from ..permissions import VIEW_AUDIT


FILTERS = ("action", "actor_type", "actor_id", "target_type", "target_id", "success", "since", "until")
# The OpenAPI "date-time" format: a date, a time and an offset, nothing left out.
RFC3339 = re.compile(r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)")
TYPED_FILTERS = {"success", "since", "until"}  # present but empty: a 400, not "no filter"


class AuditEventSerializer(ModelSerializer):
    class Meta:
        model = AuditEvent
        fields = [
            "id", "created_at", "actor_type", "actor_id", "actor_name", "action",
            "target_type", "target_id", "details", "client_ip", "success",
        ]


@extend_schema(
    tags=["audit"],
    summary="List audit events, newest first",
    parameters=[
        query_parameter("action", "Exact action, or a prefix ending in '.' (e.g. `job.`)."),
        *(query_parameter(name) for name in ("actor_type", "actor_id", "target_type", "target_id")),
        OpenApiParameter("success", bool),
        query_parameter("since", "ISO 8601 date-time (inclusive).", format="date-time"),
        query_parameter("until", "ISO 8601 date-time (exclusive).", format="date-time"),
    ],
    responses={200: AuditEventSerializer(many=True), **error_responses(400, 401, 403)},
)
class AuditEventListView(ListAPIView):
    """Filters: action (prefix match with a trailing '.', e.g. ``job.``), actor_type, actor_id,
    target_type, target_id, success (true/false), since/until (ISO 8601)."""

    serializer_class = AuditEventSerializer
    operator_permissions = {"GET": VIEW_AUDIT}

    def get_queryset(self):
        params = {name: query_param(self.request, name, typed=name in TYPED_FILTERS) for name in FILTERS}
        events = AuditEvent.objects.all()
        action = params["action"]
        if action:
            events = events.filter(action__startswith=action) if action.endswith(".") else events.filter(action=action)
        for field in ("actor_type", "actor_id", "target_type", "target_id"):
            if params[field]:
                events = events.filter(**{field: params[field]})
        if params["success"] is not None:
            value = params["success"]
            if value not in {"true", "false"}:
                raise InvalidInput("success must be true or false", code="invalid_filter")
            events = events.filter(success=value == "true")
        for field, lookup in (("since", "created_at__gte"), ("until", "created_at__lt")):
            if params[field]:
                moment = None
                if RFC3339.fullmatch(params[field]):
                    try:
                        moment = parse_datetime(params[field].upper())
                        # In UTC: PostgreSQL refuses an offset past 15:59 that RFC 3339 allows (-17:58).
                        moment = moment.astimezone(dt_timezone.utc) if moment is not None else None
                    except (ValueError, OverflowError):  # no such date (2024-02-30), or past year 9999 in UTC
                        moment = None
                if moment is None:
                    raise InvalidInput(
                        f"{field} must be an RFC 3339 date-time, e.g. 2026-01-31T12:00:00Z", code="invalid_filter"
                    )
                events = events.filter(**{lookup: moment})
        return events
