"""audit_batch: the audit rows of a block are saved in one INSERT at its end, in the block's transaction."""

import pytest
from django.db import connection, transaction
from django.db.transaction import TransactionManagementError
from django.test.utils import CaptureQueriesContext

from audit.models import AuditEvent
from audit.services import Actor, audit_batch, audit_events, audit_record, audit_write, audited_atomic

pytestmark = pytest.mark.django_db

ACTOR = Actor.system("test")


def _rows(action, *target_ids):
    return audit_events(actor=ACTOR, action=action, target_type="worker", rows=[(pk, {}) for pk in target_ids])


def _inserts(captured):
    return [q["sql"] for q in captured.captured_queries if 'INSERT INTO "audit_auditevent"' in q["sql"]]


def test_rows_of_a_block_are_saved_once_at_its_end_in_the_order_written():
    with transaction.atomic(), CaptureQueriesContext(connection) as captured:
        with audit_batch():
            audit_write(_rows("worker.status_changed", "w_1", "w_2"))
            audit_record(actor=ACTOR, action="job.requeued", target_type="job", target_id="j_1")
            audit_write(_rows("worker.status_changed", "w_3"))
            assert AuditEvent.objects.count() == 0  # nothing saved before the block ends
        assert len(_inserts(captured)) == 1
        stored = list(AuditEvent.objects.order_by("id").values_list("action", "target_id"))

    assert stored == [
        ("worker.status_changed", "w_1"),
        ("worker.status_changed", "w_2"),
        ("job.requeued", "j_1"),
        ("worker.status_changed", "w_3"),
    ]


def test_an_audited_transaction_saves_its_rows_unsealed_and_locks_nothing_another_needs():
    """No chain head read or moved, no deferred checks forced early: the rows' INSERT is all the audit adds."""
    with CaptureQueriesContext(connection) as captured, audited_atomic():
        audit_write(_rows("worker.status_changed", "w_1", "w_2"))
        audit_record(actor=ACTOR, action="job.requeued", target_type="job", target_id="j_1")

    statements = [q["sql"] for q in captured.captured_queries]
    assert len(_inserts(captured)) == 1
    assert not [sql for sql in statements if "audit_auditchainhead" in sql or "SET CONSTRAINTS" in sql]
    assert list(AuditEvent.objects.values_list("seq", "chain_hash")) == [(None, "")] * 3


def test_a_block_left_by_an_exception_saves_nothing():
    with pytest.raises(RuntimeError), transaction.atomic(), audit_batch():
        audit_write(_rows("worker.status_changed", "w_1"))
        raise RuntimeError("the change failed")

    assert AuditEvent.objects.count() == 0


@pytest.mark.django_db(transaction=True)
def test_a_batch_needs_a_transaction():
    with pytest.raises(TransactionManagementError), audit_batch():
        pass


def test_rows_written_in_a_savepoint_are_held_for_the_batch_and_dropped_if_it_rolls_back():
    with transaction.atomic(), audit_batch():
        audit_write(_rows("worker.status_changed", "w_kept"))
        with pytest.raises(RuntimeError), transaction.atomic():
            audit_write(_rows("worker.status_changed", "w_rolled_back"))
            raise RuntimeError("the savepoint rolls back")
        with transaction.atomic():
            audit_write(_rows("worker.status_changed", "w_released"))
        assert AuditEvent.objects.count() == 0  # held: saved at the batch's end only

    assert list(AuditEvent.objects.order_by("id").values_list("target_id", flat=True)) == ["w_kept", "w_released"]


def test_a_transaction_marked_for_rollback_saves_nothing():
    with transaction.atomic():
        with audit_batch():
            audit_write(_rows("worker.status_changed", "w_1"))
            transaction.set_rollback(True)
        transaction.set_rollback(False)  # only so the test can look: the batch has already decided

    assert AuditEvent.objects.count() == 0


def test_a_batch_inside_a_batch_joins_it():
    with transaction.atomic(), CaptureQueriesContext(connection) as captured:
        with audit_batch():
            audit_write(_rows("worker.status_changed", "w_1"))
            with audit_batch():
                audit_write(_rows("worker.status_changed", "w_2"))
            assert AuditEvent.objects.count() == 0
        assert len(_inserts(captured)) == 1

    assert AuditEvent.objects.count() == 2


def test_the_change_feed_names_every_target_of_the_batch_once_committed(commit, operator_changes):
    with commit(), transaction.atomic(), audit_batch():
        audit_write(_rows("worker.status_changed", "w_1", "w_2"))
        audit_record(actor=ACTOR, action="job.requeued", target_type="job", target_id="j_1")
        assert operator_changes == []

    (announced,) = operator_changes
    assert {(t["type"], t["id"]) for t in announced["targets"]} == {("worker", "w_1"), ("worker", "w_2"), ("job", "j_1")}
