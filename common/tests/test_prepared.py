"""PreparedQuery: the ORM's read, compiled once, gives the ORM's rows for every later call's values."""

from datetime import timedelta
from unittest import mock

import pytest
from django.db import connection, transaction
from django.db.models import BooleanField, ExpressionWrapper, Q
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from common import prepared as prepared_module
from common.prepared import PreparedQuery
from job_queue.models import Job
from job_queue.tests.factories import JobFactory
from workers.models import Token, TokenKind, Worker, WorkerStatus
from workers.services import token_issue
from workers.tests.factories import UserFactory, WorkerFactory

pytestmark = pytest.mark.django_db


def _tokens(*, kind, prefix, now):
    return (
        Token.objects.filter(kind=kind, prefix=prefix)
        .filter(Q(expires_at__isnull=True) | Q(expires_at__gt=now))
        .select_related("worker", "user")
        .annotate(fresh=ExpressionWrapper(Q(created_at__gt=now), output_field=BooleanField()))
        .order_by("pk")
    )


def _fields(token):
    return (token.pk, token.kind, token.prefix, token.expires_at, token.created_at, token.last_used_at, token.fresh,
            token.worker and (token.worker.pk, token.worker.labels, token.worker.last_heartbeat),
            token.user and (token.user.pk, token.user.username))  # fmt: skip


def test_every_call_gets_the_rows_the_orm_would_give_for_its_values():
    now = timezone.now()
    worker = WorkerFactory(labels={"gpu": "a100"}, last_heartbeat=now)
    issued = [
        token_issue(kind=TokenKind.WORKER, worker=worker)[0],
        token_issue(kind=TokenKind.WORKER, worker=worker, expires_at=now + timedelta(hours=1))[0],
        token_issue(kind=TokenKind.API, user=UserFactory())[0],
    ]
    Token.objects.filter(pk=issued[1].pk).update(expires_at=now - timedelta(seconds=1))
    prepared = PreparedQuery(_tokens)
    cases = [
        {"kind": kind, "prefix": token.prefix, "now": moment}
        for token in issued
        for kind in (TokenKind.WORKER, TokenKind.API)
        for moment in (now, now - timedelta(hours=2), now + timedelta(days=1))
    ]
    for values in cases:
        assert [_fields(t) for t in prepared.run(**values)] == [_fields(t) for t in _tokens(**values)], values
    got = prepared.first(kind=TokenKind.WORKER, prefix=issued[0].prefix, now=now)
    assert got.worker.labels == {"gpu": "a100"} and got.worker.last_heartbeat == now  # converted, not strings
    assert got._state.db == "default" and not got._state.adding
    assert prepared.first(kind=TokenKind.WORKER, prefix="nothing", now=now) is None


def test_the_queryset_is_built_and_compiled_once_not_per_call():
    build = mock.Mock(side_effect=_tokens)
    prepared = PreparedQuery(build)
    now = timezone.now()
    for _ in range(5):
        prepared.run(kind=TokenKind.WORKER, prefix="wt_x", now=now)
    assert build.call_count == 2  # the first call's values and the derived second set


def test_a_value_equal_to_a_constant_of_the_query_still_goes_to_its_own_slot():
    idle = WorkerFactory(name="idle", status=WorkerStatus.IDLE)
    WorkerFactory(name="offline", status=WorkerStatus.OFFLINE)
    prepared = PreparedQuery(lambda *, name: Worker.objects.filter(status=WorkerStatus.IDLE, name=name))
    assert [w.pk for w in prepared.run(name="idle")] == [idle.pk]  # "idle" is also the status constant
    assert prepared.run(name="offline") == []


@pytest.mark.parametrize(
    ("build", "values", "reason"),
    [
        (lambda *, name: Worker.objects.filter(name__icontains=name), {"name": "a"}, "not one of its values"),
        (lambda *, name: Worker.objects.filter(name=name), {"name": None}, "must not be None"),
        (lambda *, names: Worker.objects.filter(name__in=names), {"names": ["a", "b"]}, "str, int or datetime"),
        (lambda *, name: Worker.objects.filter(name=name).values("pk"), {"name": "a"}, "model instances"),
        (lambda *, name: Worker.objects.filter(name=name) if name == "a" else Worker.objects.filter(pk=name),
         {"name": "a"}, "depends on its values"),
    ],
)  # fmt: skip
def test_a_query_it_cannot_run_as_the_orm_would_is_refused_at_its_first_call(build, values, reason):
    with pytest.raises(TypeError, match=reason):
        PreparedQuery(build).run(**values)


@pytest.mark.postgres  # SQLite has no SELECT ... FOR UPDATE: its writers serialize on the database lock
@pytest.mark.django_db(transaction=True)
def test_a_locking_read_outside_a_transaction_is_refused_as_the_orm_refuses_it(postgres_url):
    assert connection.vendor == "postgresql"  # the test database follows DATABASE_URL
    job = JobFactory()
    prepared = PreparedQuery(lambda *, pk: Job.objects.select_for_update().filter(pk=pk)[:1])
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        assert prepared.first(pk=job.pk).pk == job.pk
    assert queries[0]["sql"].endswith("FOR UPDATE")
    with pytest.raises(TransactionManagementError):
        prepared.first(pk=job.pk)


def test_each_shape_gets_its_own_plan_and_past_the_cap_a_call_runs_the_orm_queryset(monkeypatch):
    monkeypatch.setattr(prepared_module, "MAX_PLANS", 2)
    for i in range(3):
        WorkerFactory(name=f"w{i}")
    build = mock.Mock(side_effect=lambda start, stop, *, least: Worker.objects.filter(name__gte=least).order_by("name")[start:stop])
    prepared = PreparedQuery(build)

    def names(*shape, least):
        return [worker.name for worker in prepared.run(*shape, least=least)]

    assert names(0, 2, least="w0") == ["w0", "w1"]
    assert names(1, 3, least="w0") == ["w1", "w2"]  # another slice: another plan
    assert names(0, 2, least="w1") == ["w1", "w2"]  # the first plan, other values
    assert build.call_count == 4  # two per plan, none per call
    assert names(2, 3, least="w0") == ["w2"]  # a third shape, past the cap
    assert build.call_count == 5  # built as the ORM would, and not kept
