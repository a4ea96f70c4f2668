"""DRF authentication for the two kinds of bearer token: operators (Authorization) and workers (X-Worker-Token).

A refused token is a 401, or a 429 once its address is past the failure rate (``workers.throttling``).
"""

from rest_framework import authentication, exceptions, permissions

from worker_agent import protocol

from .models import TokenKind
from .services import token_authenticate
from .throttling import authentication_failed

WORKER_TOKEN_HEADER = protocol.WORKER_TOKEN_HEADER
THROTTLED = "Too many failed authentications from this address."


def refuse(request, *, kind, presented, reason):
    """Raise the refusal of a token ``presented`` with ``request``: AuthenticationFailed (401), or
    Throttled (429 with Retry-After) past the failure rate. Counted and audited (bounded) either way."""
    wait = authentication_failed(request, kind=kind, presented=presented, reason=reason)
    if wait is not None:
        raise exceptions.Throttled(wait=wait, detail=THROTTLED)
    raise exceptions.AuthenticationFailed(reason)


class BearerTokenAuthentication(authentication.BaseAuthentication):
    """``Authorization: Bearer sta_...`` for operators; the user is the token's owner."""

    keyword = "Bearer"

    def authenticate(self, request):
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            return None
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != self.keyword.lower():
            return None
        secret = secret.strip()
        if not secret:
            refuse(request, kind=TokenKind.API, presented="", reason="Bearer token missing")
        token = token_authenticate(kind=TokenKind.API, plaintext=secret)
        if token is None or not token.user.is_active:
            refuse(request, kind=TokenKind.API, presented=secret, reason="Invalid or revoked API token")
        return token.user, token

    def authenticate_header(self, request):
        return self.keyword


class WorkerPrincipal:
    """``request.user`` on worker endpoints: the authenticated worker and the token it used."""

    is_authenticated = True
    is_anonymous = False
    is_active = True

    def __init__(self, token):
        self.token = token
        self.worker = token.worker
        self.pk = None

    def get_username(self):
        return self.worker.name

    def has_perm(self, perm, obj=None):
        return False


class WorkerTokenAuthentication(authentication.BaseAuthentication):
    """``X-Worker-Token: wt_...``, the only credential of a worker endpoint: a missing, unknown or
    revoked token is a failed authentication (401, or 429 past the rate)."""

    def authenticate(self, request):
        secret = request.headers.get(WORKER_TOKEN_HEADER)
        if not secret:
            refuse(request, kind=TokenKind.WORKER, presented="", reason=f"{WORKER_TOKEN_HEADER} header is required")
        token = token_authenticate(kind=TokenKind.WORKER, plaintext=secret)
        if token is None:
            refuse(
                request,
                kind=TokenKind.WORKER,
                presented=secret,
                reason="Invalid token: it may have been rotated; request a new one",
            )
        return WorkerPrincipal(token), token

    def authenticate_header(self, request):
        return f'Token realm="worker", header="{WORKER_TOKEN_HEADER}"'


class IsWorker(permissions.BasePermission):
    message = f"A worker token ({WORKER_TOKEN_HEADER}) is required"

    def has_permission(self, request, view):
        return isinstance(request.user, WorkerPrincipal)

