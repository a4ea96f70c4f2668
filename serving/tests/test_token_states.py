"""Token validity has one definition (``workers.services._active_tokens``): every path that checks a token gives its
answer, for a token in every state, with the fast paths on and off."""

import json
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.core.handlers.asgi import ASGIHandler
from django.db import connection
from django.utils import timezone

from audit.services import Actor
from serving.asgi import FastPathsASGIHandler
from simpletuner_site.tests.asgi_support import asgi_request
from worker_agent import protocol
from workers.models import Token, TokenKind
from workers.services import token_authenticate, worker_rotate_token, worker_token_sql
from workers.tests.factories import UserFactory, WorkerFactory, api_token, worker_token
from workers.tests.support import clear_failed_auth_counters

pytestmark = pytest.mark.django_db(transaction=True)

STATES = ["active", "expires later", "expired", "revoked", "rotated", "deleted worker", "an operator's token", "unknown"]
VALID = {"active", "expires later"}


def worker_secret_in(state):
    """Return ``(secret presented as a worker token, the worker it names)`` for a token in ``state``."""
    worker = WorkerFactory(last_heartbeat=timezone.now() - timedelta(minutes=5))
    secret = worker_token(worker)
    token = Token.objects.get(worker=worker)
    now = timezone.now()
    if state == "expires later":
        Token.objects.filter(pk=token.pk).update(expires_at=now + timedelta(hours=1))
    elif state == "expired":
        Token.objects.filter(pk=token.pk).update(expires_at=now - timedelta(seconds=1))
    elif state == "revoked":
        Token.objects.filter(pk=token.pk).update(revoked_at=now)
    elif state == "rotated":
        worker_rotate_token(worker_id=worker.pk, actor=Actor.system())
    elif state == "deleted worker":
        worker.delete()
    elif state == "an operator's token":
        secret = api_token(UserFactory(is_superuser=True, is_staff=True))
    elif state == "unknown":
        secret = "wt_" + "x" * 40
    return secret, worker


def heartbeat(app, secret):
    body = json.dumps({"status": "idle"}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (protocol.WORKER_TOKEN_HEADER.lower().encode(), secret.encode())]  # fmt: skip
    return async_to_sync(asgi_request)(app, "POST", protocol.HEARTBEAT_PATH, body=body, headers=headers)


@pytest.mark.parametrize("state", STATES)
def test_every_path_that_checks_a_worker_token_agrees(state):
    clear_failed_auth_counters()
    secret, worker = worker_secret_in(state)
    valid = state in VALID

    # The rule, read by the ORM (as authentication does) ...
    assert (token_authenticate(kind=TokenKind.WORKER, plaintext=secret) is not None) == valid
    # ... compiled into the heartbeat's statement ...
    worker_sql, params, _, _ = worker_token_sql(plaintext=secret, now=timezone.now())
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {worker_sql}", params)
        assert cursor.fetchone()[0] == (worker.pk if valid else None)
    # ... and through the fast paths and Django's own handler, with the same answer.
    fast_status, _, fast_body = heartbeat(FastPathsASGIHandler(), secret)
    plain_status, _, plain_body = heartbeat(ASGIHandler(), secret)
    assert fast_status == plain_status == (200 if valid else 401)
    assert json.loads(fast_body) == json.loads(plain_body)


@pytest.mark.parametrize("presented", ["operator token", "worker token", "revoked operator token"])
def test_an_operator_endpoint_takes_only_an_active_operator_token(presented):
    clear_failed_auth_counters()
    user = UserFactory(is_superuser=True, is_staff=True)
    secret = worker_token(WorkerFactory()) if presented == "worker token" else api_token(user)
    if presented == "revoked operator token":
        Token.objects.filter(user=user).update(revoked_at=timezone.now())
    valid = presented == "operator token"

    assert (token_authenticate(kind=TokenKind.API, plaintext=secret) is not None) == valid
    answers = [
        async_to_sync(asgi_request)(app, "GET", "/api/admin/workers", headers=[(b"authorization", f"Bearer {secret}".encode())])
        for app in (FastPathsASGIHandler(), ASGIHandler())
    ]
    assert [status for status, _, _ in answers] == [200 if valid else 401] * 2
