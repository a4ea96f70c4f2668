"""OpenAPI pieces drf-spectacular cannot infer: the two token schemes and the (non-DRF) SSE stream path."""

from drf_spectacular.extensions import OpenApiAuthenticationExtension

from worker_agent import protocol
ERROR_REF = {"$ref": "#/components/schemas/Error"}
# What the stream accepts as a resume point: ``channel:id`` pairs, comma-separated (anything else is a 400).
LAST_EVENT_ID_PATTERN = r"^[^,:]*:[^,:]*(,[^,:]*:[^,:]*)*$"


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "workers.authentication.BearerTokenAuthentication"
    name = "operatorToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "An operator's API token: `Authorization: Bearer sta_...`.",
        }


class WorkerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "workers.authentication.WorkerTokenAuthentication"
    name = "workerToken"

    def get_security_definition(self, auto_schema):
        return {
            "type": "apiKey",
            "in": "header",
            "name": protocol.WORKER_TOKEN_HEADER,
            "description": "A worker's token: `X-Worker-Token: wt_...` (shown once, at creation or rotation).",
        }


def _error(description):
    return {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}


def add_worker_stream_path(result, generator, request, public):
    """Postprocessing hook: document GET /api/workers/stream, an async Django view the generator cannot see."""
    result.setdefault("paths", {})[protocol.STREAM_PATH] = {
        "get": {
            "operationId": "workers_stream",
            "tags": ["workers"],
            "summary": "Open the worker's dispatch feed (Server-Sent Events)",
            "description": (
                "A long-lived `text/event-stream` of the calling worker's events (`job_submit`, `job_cancel`, "
                "`shutdown`, `stream-reset`, ...), each `data:` a JSON object with a `type`. Resume with "
                "`Last-Event-ID`; an event missed while disconnected is replayed."
            ),
            "parameters": [
                {
                    "in": "query",
                    "name": "worker_id",
                    "schema": {"type": "string"},
                    "description": "Optional; must be the token's own worker (403 otherwise).",
                },
                {
                    "in": "query",
                    "name": "lastEventId",
                    "schema": {"type": "string", "pattern": LAST_EVENT_ID_PATTERN},
                    "description": "Same as the Last-Event-ID header, for clients that cannot set headers.",
                },
                {
                    "in": "header",
                    "name": "Last-Event-ID",
                    "schema": {"type": "string", "pattern": LAST_EVENT_ID_PATTERN},
                    "description": "Resume after this event id.",
                },
            ],
            "security": [{WorkerTokenScheme.name: []}],
            "responses": {
                "200": {
                    "description": "The event stream; stays open until the worker disconnects or is revoked.",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}},
                },
                "400": _error("Malformed Last-Event-ID (`invalid_last_event_id`)"),
                "401": _error("Missing, unknown or revoked worker token (`not_authenticated`)"),
                "403": _error("worker_id names a different worker than the token's (`permission_denied`)"),
            },
        }
    }
    result["paths"] = dict(sorted(result["paths"].items()))
    schemes = result.setdefault("components", {}).setdefault("securitySchemes", {})
    schemes.setdefault(WorkerTokenScheme.name, WorkerTokenScheme(None).get_security_definition(None))
    return result
