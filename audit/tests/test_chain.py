"""The audit chain: every row, once sealed, hashed onto the one sealed before it; edits, deletions and reorderings
of sealed rows found by verify_audit, which also reports the rows not sealed yet."""

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
from audit.sweeps import seal_chain
from audit.tests.factories import AuditEventFactory

pytestmark = pytest.mark.django_db

ACTOR = Actor("user", "7", "operator", "2001:DB8:0:0:1:0:0:1")
TABLE = AuditEvent._meta.db_table


def _write_many(count, *, sealed=True):
    """Write ``count`` rows the ways services do, then (``sealed``) seal them."""
    for n in range(count):
        if n % 3 == 0:
            audit_record(actor=ACTOR, action="job.submitted", target_type="job", target_id=f"j_{n}", details={"n": n})
        elif n % 3 == 1:
            with audited_atomic():
                audit_record(actor=Actor.system("sweep"), action="worker.offline", target_type="worker", target_id=f"w_{n}")
        else:
            with transaction.atomic(), audit_batch():
                audit_write(audit_events(actor=ACTOR, action="job.requeued", target_type="job", rows=[(f"j_{n}", {})]))
    if sealed:
        assert seal_chain() == {"sealed": count}


def _raw(sql, params):
    with connection.cursor() as cursor:
        cursor.execute(sql.format(table=connection.ops.quote_name(TABLE)), params)


def test_rows_are_written_unsealed_then_sealed_gap_free_in_id_order_and_verify_intact():
    _write_many(30, sealed=False)
    assert set(AuditEvent.objects.values_list("seq", "chain_hash")) == {(None, "")}
    report = audit_chain_verify()
    assert (report.intact, report.checked, report.unsealed) == (True, 0, 30)

    assert seal_chain() == {"sealed": 30}

    assert list(AuditEvent.objects.order_by("id").values_list("seq", flat=True)) == list(range(1, 31))
    head = AuditChainHead.objects.get()
    last = AuditEvent.objects.get(seq=30)
    assert (head.seq, head.chain_hash) == (30, last.chain_hash)
    report = audit_chain_verify()
    assert (report.intact, report.checked, report.unsealed, report.oldest_unsealed) == (True, 30, 0, None)
    assert seal_chain() == {"sealed": 0}


def test_a_pass_seals_at_most_its_batch_and_the_next_passes_go_on_from_its_head():
    _write_many(10, sealed=False)

    assert seal_chain(batch=4) == {"sealed": 10}  # 4, 4, 2

    assert list(AuditEvent.objects.order_by("id").values_list("seq", flat=True)) == list(range(1, 11))
    assert audit_chain_verify().checked == 10


def test_rows_written_after_a_pass_are_chained_after_its_rows():
    _write_many(4)
    _write_many(5)

    assert AuditChainHead.objects.get().seq == 9
    report = audit_chain_verify()
    assert report.intact and report.checked == 9


def test_a_pass_with_nothing_to_seal_takes_no_lock(django_assert_num_queries):
    _write_many(2)

    with django_assert_num_queries(1) as captured:  # one look for unsealed rows, no transaction, no head
        assert seal_chain() == {"sealed": 0}
    assert "audit_auditchainhead" not in captured.captured_queries[0]["sql"]


def test_the_celery_task_seals_what_is_unsealed():
    from audit import tasks

    _write_many(2, sealed=False)

    assert tasks.seal_chain() == {"sealed": 2}
    assert audit_chain_verify().checked == 2


def test_a_lost_head_row_is_remade_from_the_last_sealed_row():
    _write_many(3)
    AuditChainHead.objects.all().delete()  # as a test database's flush leaves it
    _write_many(2)

    assert AuditChainHead.objects.get().seq == 5
    assert audit_chain_verify().intact and audit_chain_verify().checked == 5


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
    seal_chain()

    report = audit_chain_verify()
    assert report.intact and report.checked == 1


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


def test_reordered_rows_are_broken_links_at_both_places():
    _write_many(6)
    _raw("UPDATE {table} SET seq = -1 WHERE seq = 2", [])  # swap seq 2 and 4 (seq is unique: by way of -1)
    _raw("UPDATE {table} SET seq = 2 WHERE seq = 4", [])
    _raw("UPDATE {table} SET seq = 4 WHERE seq = -1", [])

    report = audit_chain_verify()
    assert [(f.kind, f.seq) for f in report.faults] == [("broken", 2), ("broken", 3), ("broken", 4), ("broken", 5)]


def test_rows_moved_whole_hash_included_are_broken_links_at_both_places():
    _write_many(6)
    (second, hash_2), (fourth, hash_4) = AuditEvent.objects.filter(seq__in=[2, 4]).order_by("seq").values_list("id", "chain_hash")
    _raw("UPDATE {table} SET seq = -1 WHERE id = %s", [second])
    _raw("UPDATE {table} SET seq = 2, chain_hash = %s WHERE id = %s", [hash_2, fourth])
    _raw("UPDATE {table} SET seq = 4, chain_hash = %s WHERE id = %s", [hash_4, second])

    report = audit_chain_verify()
    assert [(f.kind, f.seq) for f in report.faults] == [("broken", 2), ("broken", 4)]


def test_a_sealed_row_made_unsealed_leaves_a_missing_link_even_once_sealed_again():
    _write_many(5)
    _raw("UPDATE {table} SET seq = NULL, chain_hash = '' WHERE seq = 3", [])
    assert audit_chain_verify().unsealed == 1

    assert seal_chain() == {"sealed": 1}  # chained again at the end, as any row found unsealed

    report = audit_chain_verify()
    assert [(f.kind, f.seq) for f in report.faults] == [("missing", 3)]
    assert AuditEvent.objects.order_by("-seq").values_list("seq", flat=True)[0] == 6


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
    seal_chain()

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
    seal_chain()
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
    seal_chain()

    call_command("verify_audit", "--since", "2024-03-02", "--until", "2024-03-03T00:00:00+00:00")
    assert "1 links checked (seq 2-2)" in capsys.readouterr().out
    call_command("verify_audit", "--since", "2030-01-01")
    assert "No sealed audit rows in that range." in capsys.readouterr().out


def test_verify_audit_says_how_many_rows_are_not_sealed_yet_and_the_oldest_age(capsys):
    _write_many(3)
    AuditEventFactory(created_at=datetime.now(timezone.utc) - timedelta(minutes=5))
    AuditEventFactory()

    call_command("verify_audit")
    out = capsys.readouterr().out
    assert "Not sealed yet: 2 row(s), the oldest written 30" in out  # 300.x s
    assert "Audit chain intact: 3 links checked (seq 1-3)" in out
    seal_chain()
    call_command("verify_audit")
    assert "Not sealed yet: no rows." in capsys.readouterr().out


def test_a_large_batch_is_saved_in_one_call_each_row_with_its_own_id_then_sealed():
    """More rows than one SQLite statement takes (Django splits them): every row saved with the id the
    database gave it, then sealed in order."""
    AuditEventFactory(target_id="before")
    rows = [(f"j_{n}", {"n": n, "f": 1.0}) for n in range(1200)]

    with transaction.atomic(), audit_batch():
        saved = audit_write(audit_events(actor=ACTOR, action="job.requeued", target_type="job", rows=rows))

    stored = dict(AuditEvent.objects.filter(action="job.requeued").values_list("pk", "target_id"))
    assert {event.pk: event.target_id for event in saved} == stored
    assert not any(event._state.adding for event in saved)
    assert seal_chain() == {"sealed": 1201}
    assert [seq for _pk, seq in AuditEvent.objects.order_by("id").values_list("pk", "seq")] == list(range(1, 1202))
    assert audit_chain_verify().intact and audit_chain_verify().checked == 1201
