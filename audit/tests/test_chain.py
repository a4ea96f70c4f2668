"""The audit chain: every row hashed onto the one before it; edits and deletions found by verify_audit."""

import importlib
from datetime import datetime, timedelta, timezone

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.db.migrations.executor import MigrationExecutor
from django.test import override_settings

from audit.models import AuditChainHead, AuditEvent
from audit.selectors import audit_chain_verify
from audit.services import Actor, audit_batch, audit_events, audit_record, audit_write, audited_atomic
from audit.tests.factories import AuditEventFactory

pytestmark = pytest.mark.django_db

ACTOR = Actor("user", "7", "operator", "2001:DB8:0:0:1:0:0:1")
TABLE = AuditEvent._meta.db_table


def _write_many(count):
    for n in range(count):
        if n % 3 == 0:
            audit_record(actor=ACTOR, action="job.submitted", target_type="job", target_id=f"j_{n}", details={"n": n})
        elif n % 3 == 1:
            with audited_atomic():
                audit_record(actor=Actor.system("sweep"), action="worker.offline", target_type="worker", target_id=f"w_{n}")
        else:
            with transaction.atomic(), audit_batch():
                audit_write(audit_events(actor=ACTOR, action="job.requeued", target_type="job", rows=[(f"j_{n}", {})]))


def _raw(sql, params):
    with connection.cursor() as cursor:
        cursor.execute(sql.format(table=connection.ops.quote_name(TABLE)), params)


def test_rows_are_chained_gap_free_and_verify_intact():
    _write_many(30)

    seqs = list(AuditEvent.objects.order_by("seq").values_list("seq", flat=True))
    assert seqs == list(range(1, 31))
    head = AuditChainHead.objects.get()
    last = AuditEvent.objects.get(seq=30)
    assert (head.seq, head.chain_hash) == (30, last.chain_hash)
    report = audit_chain_verify()
    assert report.intact and report.checked == 30


ODD_DETAILS = {
    "floats": [1.0, 1e16, 1.5e300, -0.0, 0.1, 1e-7, 2.5],
    "big": 2**70,
    "nested": {"z": [{"b": None, "a": True}], "é": "ünïcødé ✓", 3: "an integer key"},
    "tuple": ("a", 1),
    "empty": {},
}


@pytest.mark.parametrize("ip", ["2001:DB8:0:0:1:0:0:1", "::ffff:1.2.3.4", "10.0.0.1", "", None])
def test_what_the_database_gives_back_hashes_as_it_was_written(ip):
    """jsonb reorders keys and rewrites numbers; inet and GenericIPAddressField normalise addresses."""
    audit_record(actor=Actor("user", "1", "op", ip), action="job.submitted", target_type="job", details=ODD_DETAILS)

    assert audit_chain_verify().intact


@pytest.mark.parametrize(
    "column, value",
    [
        ("details", '{"n": 999}'),
        ("actor_name", "someone else"),
        ("action", "job.cancelled"),
        ("success", False),
        ("client_ip", "10.9.9.9"),
        ("created_at", datetime(2020, 1, 1, tzinfo=timezone.utc)),
    ],
)
def test_an_edited_row_is_a_broken_link_at_its_seq(column, value):
    _write_many(9)
    if column == "created_at":
        value = connection.ops.adapt_datetimefield_value(value)
    _raw(f"UPDATE {{table}} SET {column} = %s WHERE seq = 4", [value])

    report = audit_chain_verify()
    assert not report.intact
    assert [(f.kind, f.seq) for f in report.faults] == [("broken", 4)]
    assert report.checked == 9


def test_a_deleted_row_is_a_missing_link_and_so_is_a_deleted_last_row():
    _write_many(9)
    _raw("DELETE FROM {table} WHERE seq IN (5, 9)", [])

    report = audit_chain_verify()
    assert [(f.kind, f.seq) for f in report.faults] == [("missing", 5), ("missing", 9)]
    assert report.checked == 6  # row 6 links to the deleted row 5: it cannot be checked


def test_a_row_slipped_in_before_the_chain_is_found():
    _write_many(2)
    AuditEvent(actor_type="system", action="job.submitted", seq=0, chain_hash="00" * 32).save()

    report = audit_chain_verify()
    assert [(f.kind, f.seq) for f in report.faults] == [("broken", 0)]


def test_a_rolled_back_savepoint_leaves_no_gap():
    with audited_atomic():
        audit_record(actor=ACTOR, action="job.submitted", target_type="job", target_id="j_1")
        with pytest.raises(RuntimeError), audited_atomic():
            audit_record(actor=ACTOR, action="job.submitted", target_type="job", target_id="j_gone")
            raise RuntimeError("the savepoint rolls back")
        audit_record(actor=ACTOR, action="job.submitted", target_type="job", target_id="j_2")

    assert list(AuditEvent.objects.order_by("seq").values_list("seq", "target_id")) == [(1, "j_1"), (2, "j_2")]
    assert audit_chain_verify().intact


def test_the_key_matters():
    _write_many(3)

    with override_settings(SIMPLETUNER_AUDIT_KEY="not the key the rows were written with"):
        report = audit_chain_verify()
    assert [(f.kind, f.seq) for f in report.faults] == [("broken", 1), ("broken", 2), ("broken", 3)]


def test_a_replaced_hash_breaks_its_link_and_the_next():
    """Whoever can write the table but lacks the key cannot make a forged hash verify."""
    _write_many(4)
    _raw("UPDATE {table} SET chain_hash = %s WHERE seq = 2", ["ab" * 32])

    report = audit_chain_verify()
    assert [(f.kind, f.seq) for f in report.faults] == [("broken", 2), ("broken", 3)]


def test_since_and_until_check_a_range_anchored_on_the_row_before_it():
    base = datetime(2024, 1, 1, tzinfo=timezone.utc)
    for day in range(10):
        AuditEventFactory(created_at=base + timedelta(days=day))
    _raw("UPDATE {table} SET actor_name = 'x' WHERE seq = 2", [])  # outside the range below

    report = audit_chain_verify(since=base + timedelta(days=4), until=base + timedelta(days=7))
    assert report.intact and (report.first_seq, report.last_seq, report.checked) == (5, 7, 3)
    assert not audit_chain_verify(since=base).intact


def test_the_data_migration_chains_rows_as_the_writer_does():
    _write_many(7)
    before = list(AuditEvent.objects.order_by("id").values_list("seq", "chain_hash"))
    migration = importlib.import_module("audit.migrations.0003_chain_existing_rows")
    migration.BATCH = 3  # several batches
    state = MigrationExecutor(connection).loader.project_state(("audit", "0004_seq_unique"))
    migration.chain_existing_rows(state.apps, None)  # historical models, as the migration gets them

    assert list(AuditEvent.objects.order_by("id").values_list("seq", "chain_hash")) == before
    assert AuditChainHead.objects.get().seq == 7


# --- manage.py verify_audit -------------------------------------------------------------------


def test_verify_audit_exits_0_when_intact(capsys):
    _write_many(5)

    call_command("verify_audit")
    assert "Audit chain intact: 5 links checked (seq 1-5)" in capsys.readouterr().out


def test_verify_audit_exits_1_naming_the_first_fault(capsys):
    _write_many(6)
    _raw("UPDATE {table} SET details = %s WHERE seq = 3", ['{"n": 1}'])
    _raw("DELETE FROM {table} WHERE seq = 5", [])

    with pytest.raises(SystemExit) as exited:
        call_command("verify_audit")
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert "First broken link at seq 3 (id " in err
    assert "then missing at seq 5" in err
    assert "NOT intact: 2 fault(s)" in err


def test_verify_audit_refuses_a_bad_date_with_2():
    with pytest.raises(CommandError) as refused:
        call_command("verify_audit", "--since", "yesterday")
    assert refused.value.returncode == 2


def test_verify_audit_takes_dates_and_date_times(capsys):
    AuditEventFactory(created_at=datetime(2024, 3, 1, 12, tzinfo=timezone.utc))
    AuditEventFactory(created_at=datetime(2024, 3, 2, 12, tzinfo=timezone.utc))

    call_command("verify_audit", "--since", "2024-03-02", "--until", "2024-03-03T00:00:00+00:00")
    assert "1 links checked (seq 2-2)" in capsys.readouterr().out
    call_command("verify_audit", "--since", "2030-01-01")
    assert "No audit rows in that range." in capsys.readouterr().out


@pytest.mark.parametrize("returning", [True, False], ids=["returning", "ids-by-seq"])
def test_a_large_batch_is_saved_in_chunks_each_row_with_its_own_id(monkeypatch, returning):
    """More rows than one INSERT takes: every row saved, chained and given the id the database gave it."""
    import audit.services

    monkeypatch.setattr(audit.services, "_ROWS_PER_INSERT", 7)
    monkeypatch.setattr(type(connection.features), "can_return_rows_from_bulk_insert", returning)
    AuditEventFactory(target_id="before")
    rows = [(f"j_{n}", {"n": n, "f": 1.0}) for n in range(30)]

    with transaction.atomic(), audit_batch():
        saved = audit_write(audit_events(actor=ACTOR, action="job.requeued", target_type="job", rows=rows))

    stored = dict(AuditEvent.objects.filter(action="job.requeued").values_list("pk", "target_id"))
    assert {event.pk: event.target_id for event in saved} == stored
    assert [event.seq for event in saved] == list(range(2, 32))
    assert not any(event._state.adding for event in saved)
    assert audit_chain_verify().intact and audit_chain_verify().checked == 31


@pytest.mark.parametrize("values_up_to", [0, 100], ids=["arrays", "values-in-chunks"])
def test_a_batch_is_saved_whichever_statement_form_carries_it(monkeypatch, values_up_to):
    """PostgreSQL sends a few rows as a multi-row VALUES and many as UNNEST of arrays (elsewhere always VALUES):
    either way every row is saved as chained, with its own id, and the head moves once to the last row."""
    import audit.services

    monkeypatch.setattr(audit.services, "_ROWS_PER_VALUES_POSTGRES", values_up_to)
    monkeypatch.setattr(audit.services, "_ROWS_PER_INSERT", 5)
    AuditEventFactory(target_id="before")
    rows = [(f"j_{n}", {"n": n, "when": "now", "f": 2.0}) for n in range(12)]

    with transaction.atomic(), audit_batch():
        saved = audit_write(audit_events(actor=ACTOR, action="job.requeued", target_type="job", rows=rows))

    stored = dict(AuditEvent.objects.filter(action="job.requeued").values_list("pk", "target_id"))
    assert {event.pk: event.target_id for event in saved} == stored
    assert [event.seq for event in saved] == list(range(2, 14))
    head = AuditChainHead.objects.get()
    assert (head.seq, head.chain_hash) == (13, saved[-1].chain_hash)
    assert audit_chain_verify().intact and audit_chain_verify().checked == 13
