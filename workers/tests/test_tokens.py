"""Bearer tokens: hashed at rest, prefixed by kind, revocable, rotated as a whole."""

import hashlib
from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext

from audit import actions
from audit.services import Actor
from workers.models import Token, TokenKind
from workers.services import token_authenticate, token_issue, worker_rotate_token
from workers.tests.factories import UserFactory, WorkerFactory, worker_token
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

REGISTER = "/api/workers/register"
SYSTEM = Actor.system("test")


def _stored_values(token):
    """Every column of the token's row as stored, read back from the database."""
    return Token.objects.filter(pk=token.pk).values().get()


@pytest.mark.parametrize(
    ("kind", "prefix", "owner"),
    [(TokenKind.WORKER, "wt_", "worker"), (TokenKind.API, "sta_", "user")],
)
def test_only_the_sha256_digest_of_a_token_is_stored(kind, prefix, owner):
    owners = {"worker": lambda: {"worker": WorkerFactory()}, "user": lambda: {"user": UserFactory()}}
    token, plaintext = token_issue(kind=kind, **owners[owner]())

    assert plaintext.startswith(prefix)
    assert len(plaintext) > len(prefix) + 32
    stored = _stored_values(token)
    assert stored["digest"] == hashlib.sha256(plaintext.encode()).hexdigest()
    secret_part = plaintext[len(prefix) :]
    for column, value in stored.items():
        assert plaintext not in str(value), f"plaintext stored in {column}"
        assert secret_part not in str(value), f"secret stored in {column}"


def test_prefix_column_is_a_short_recognisable_head_of_the_token():
    token, plaintext = token_issue(kind=TokenKind.WORKER, worker=WorkerFactory())

    assert token.prefix == plaintext[:10]
    assert token.prefix.startswith("wt_")


def test_two_issued_tokens_differ():
    worker = WorkerFactory()

    assert worker_token(worker) != worker_token(worker)


def test_token_authenticates_by_its_plaintext_and_ignores_surrounding_whitespace():
    worker = WorkerFactory()
    plaintext = worker_token(worker)

    assert token_authenticate(kind=TokenKind.WORKER, plaintext=plaintext).worker == worker
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=f"  {plaintext}\n").worker == worker
    assert Token.objects.get(worker=worker, revoked_at__isnull=True, last_used_at__isnull=False)


@pytest.mark.parametrize(("kind", "owner", "other"), [(TokenKind.WORKER, "worker", "user"), (TokenKind.API, "user", "worker")])
def test_authentication_is_one_read_joining_the_tokens_one_owner(kind, owner, other):
    made = {"worker": WorkerFactory, "user": UserFactory}[owner]()
    _, plaintext = token_issue(kind=kind, **{owner: made})
    token_authenticate(kind=kind, plaintext=plaintext)  # marked used now: the next one only reads

    with CaptureQueriesContext(connection) as queries:
        token = token_authenticate(kind=kind, plaintext=plaintext)
        assert (getattr(token, owner), getattr(token, other)) == (made, None)  # both known: no further query

    (read,) = [q["sql"] for q in queries.captured_queries]
    owner_table = {"worker": "workers_worker", "user": "auth_user"}
    assert f'JOIN "{owner_table[owner]}"' in read and owner_table[other] not in read


@pytest.mark.parametrize("plaintext", ["", None, "wt_not-a-real-token", "sta_not-a-real-token"])
def test_unknown_token_does_not_authenticate(plaintext):
    worker_token(WorkerFactory())

    assert token_authenticate(kind=TokenKind.WORKER, plaintext=plaintext) is None


def test_token_of_one_kind_does_not_authenticate_as_the_other():
    worker_secret = worker_token(WorkerFactory())
    _, api_secret = token_issue(kind=TokenKind.API, user=UserFactory())

    assert token_authenticate(kind=TokenKind.API, plaintext=worker_secret) is None
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=api_secret) is None


def test_revoked_token_no_longer_authenticates(worker_client):
    worker = WorkerFactory()
    token, plaintext = token_issue(kind=TokenKind.WORKER, worker=worker)
    Token.objects.filter(pk=token.pk).update(revoked_at="2024-01-01T00:00:00Z")

    assert token_authenticate(kind=TokenKind.WORKER, plaintext=plaintext) is None
    response = worker_client(worker, token=plaintext).post(REGISTER, {"name": worker.name})
    assert response.status_code == 401
    assert response.json()["code"] == "not_authenticated"


def test_rotation_revokes_every_old_token_and_the_new_one_works(worker_client):
    worker = WorkerFactory()
    old = [worker_token(worker), worker_token(worker)]

    new = worker_rotate_token(worker_id=worker.pk, actor=SYSTEM)

    assert new.startswith("wt_") and new not in old
    assert Token.objects.filter(worker=worker, revoked_at__isnull=True).count() == 1
    assert Token.objects.filter(worker=worker, revoked_at__isnull=False).count() == 2
    for secret in old:
        assert token_authenticate(kind=TokenKind.WORKER, plaintext=secret) is None
        assert worker_client(worker, token=secret).post(REGISTER, {}).status_code == 401
    assert worker_client(worker, token=new).post(REGISTER, {}).status_code == 200
    (rotated,) = audit_rows(actions.WORKER_TOKEN_ROTATED, target_id=worker.pk)
    assert rotated.details["revoked_tokens"] == 2
    assert rotated.details["token_prefix"] == new[:10]


def test_create_api_token_command_prints_a_working_token():
    out = StringIO()

    call_command("create_api_token", "alice", "--superuser", stdout=out, stderr=StringIO())

    plaintext = out.getvalue().strip().splitlines()[-1]
    assert plaintext.startswith("sta_")
    token = token_authenticate(kind=TokenKind.API, plaintext=plaintext)
    assert token.user.username == "alice" and token.user.is_superuser
    assert audit_rows(actions.API_TOKEN_CREATED, target_id=str(token.user.pk))


# --- the token rule in SQL (the heartbeat's lean path) agrees with the ORM's ---------------------


@pytest.mark.parametrize(
    "state",
    ["active", "expires later", "expired", "expires now", "revoked", "api kind", "unknown",
     "used just now", "used two minutes ago"],
)  # fmt: skip
def test_token_sql_agrees_with_the_orm_rules(state):
    from datetime import timedelta

    from django.db import connection
    from django.utils import timezone

    from workers.services import _active_tokens, _touch_due, _touched_before, worker_token_sql

    now = timezone.now()
    worker = WorkerFactory()
    kind = TokenKind.API if state == "api kind" else TokenKind.WORKER
    token, secret = token_issue(kind=kind, worker=worker if kind == TokenKind.WORKER else None,
                                user=UserFactory() if kind == TokenKind.API else None)  # fmt: skip
    changes = {
        "expires later": {"expires_at": now + timedelta(hours=1)},
        "expired": {"expires_at": now - timedelta(seconds=1)},
        "expires now": {"expires_at": now},
        "revoked": {"revoked_at": now},
        "used just now": {"last_used_at": now - timedelta(seconds=5)},
        "used two minutes ago": {"last_used_at": now - timedelta(minutes=2)},
    }.get(state, {})
    Token.objects.filter(pk=token.pk).update(**changes)
    if state == "unknown":
        secret = "wt_" + "x" * 40

    worker_sql, worker_params, touch_sql, touch_params = worker_token_sql(plaintext=secret, now=now)
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT {worker_sql}, {touch_sql}", worker_params + touch_params)
        sql_worker, sql_due = cursor.fetchone()
    orm = _active_tokens(kind=TokenKind.WORKER, plaintext=secret, now=now)
    orm_worker = orm.values_list("worker", flat=True).first()
    orm_due = Token.objects.filter(_touch_due(_touched_before(now)), digest=token.digest).exists() if state != "unknown" else None

    assert sql_worker == orm_worker
    assert (None if sql_due is None else bool(sql_due)) == orm_due
    assert (orm_worker == worker.pk) == (state in {"active", "expires later", "used just now", "used two minutes ago"})
