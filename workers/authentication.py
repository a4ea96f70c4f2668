"""DRF authentication for the two kinds of bearer token: operators (Authorization) and workers (X-Worker-Token)."""

from rest_framework import authentication, exceptions, permissions

from worker_agent import protocol

from .models import TokenKind
from .services import token_authenticate

WORKER_TOKEN_HEADER = protocol.WORKER_TOKEN_HEADER


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
            raise exceptions.AuthenticationFailed("Bearer token missing")
        token = token_authenticate(kind=TokenKind.API, plaintext=secret)
        if token is None or not token.user.is_active:
            raise exceptions.AuthenticationFailed("Invalid or revoked API token")
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
    """``X-Worker-Token: wt_...``; a missing, unknown or revoked token is a 401."""

    def authenticate(self, request):
        secret = request.headers.get(WORKER_TOKEN_HEADER)
        if secret is None:
            return None
        token = token_authenticate(kind=TokenKind.WORKER, plaintext=secret)
        if token is None:
            raise exceptions.AuthenticationFailed("Invalid token: it may have been rotated; request a new one")
        return WorkerPrincipal(token), token

    def authenticate_header(self, request):
        return f'Token realm="worker", header="{WORKER_TOKEN_HEADER}"'


class IsWorker(permissions.BasePermission):
    message = f"A worker token ({WORKER_TOKEN_HEADER}) is required"

    def has_permission(self, request, view):
        return isinstance(request.user, WorkerPrincipal)

