"""Domain errors raised by services; the API turns each into JSON ``{"code", "detail"}`` with its status."""

from worker_agent import protocol


class ServiceError(Exception):
    status_code = 400
    code = "invalid"

    def __init__(self, detail, *, code=None, extra=None):
        super().__init__(detail)
        self.detail = detail
        if code:
            self.code = code
        self.extra = extra or {}


class InvalidInput(ServiceError):
    status_code = 400
    code = "invalid"


class NotFound(ServiceError):
    status_code = 404
    code = "not_found"


class Conflict(ServiceError):
    status_code = 409
    code = "conflict"


class InvalidTransition(Conflict):
    code = "invalid_transition"


class StaleReport(Conflict):
    """A worker reported on a job (or attempt) it no longer owns."""

    code = "stale_report"


class NotAuthenticated(ServiceError):
    """Credentials a service checks itself (an upload token) are missing or unknown."""

    status_code = 401
    code = protocol.NOT_AUTHENTICATED


class TooLarge(ServiceError):
    status_code = 413
    code = "request_too_large"
