"""first_rows: statements sent together (one pipeline on PostgreSQL) answer as they would one by one."""

import psycopg
import pytest
from django.db import DatabaseError, connection, transaction
from django.test.utils import CaptureQueriesContext

from common.pipeline import first_rows
from workers.models import Worker
from workers.tests.factories import WorkerFactory

pytestmark = pytest.mark.django_db(transaction=True)

TABLE = Worker._meta.db_table


def _rename(pk, name):
    return f'UPDATE "{TABLE}" SET "name" = %s WHERE "id" = %s RETURNING "id", "name"', [name, pk]


@pytest.fixture
def pipelines(monkeypatch):
    """How many pipelines psycopg entered (PostgreSQL only)."""
    entered = []
    original = psycopg.Connection.pipeline

    def counted(self):
        entered.append(1)
        return original(self)

    monkeypatch.setattr(psycopg.Connection, "pipeline", counted)
    return entered


def test_each_statement_gives_its_first_row_in_order_and_none_where_it_matched_nothing(pipelines):
    a, b = WorkerFactory(), WorkerFactory()

    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        rows = first_rows([_rename(a.pk, "first"), _rename("w_missing", "nobody"), _rename(b.pk, "second"),
                           (f'SELECT COUNT(*) FROM "{TABLE}"', [])])

    assert rows == [(a.pk, "first"), None, (b.pk, "second"), (2,)]
    assert [Worker.objects.get(pk=pk).name for pk in (a.pk, b.pk)] == ["first", "second"]
    assert len([q for q in queries.captured_queries if q["sql"].startswith(("UPDATE", "SELECT"))]) == 4
    assert len(pipelines) == (1 if connection.vendor == "postgresql" else 0)


def test_a_statement_without_rows_to_return_gives_none():
    worker = WorkerFactory()
    with transaction.atomic():
        rows = first_rows([(f'UPDATE "{TABLE}" SET "name" = %s WHERE "id" = %s', ["plain", worker.pk]),
                           _rename(worker.pk, "after")])
    assert rows == [None, (worker.pk, "after")]


def test_an_error_is_djangos_and_the_transaction_keeps_nothing():
    worker = WorkerFactory(name="before")
    with pytest.raises(DatabaseError), transaction.atomic():
        first_rows([_rename(worker.pk, "changed"), _rename(worker.pk, None),  # NOT NULL
                    _rename(worker.pk, "again")])
    assert Worker.objects.get(pk=worker.pk).name == "before"
    assert Worker.objects.count() == 1  # the connection serves the next statement
