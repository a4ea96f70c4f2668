"""The sealer thread: a committed audit row wakes it, and it seals the row without the request waiting."""

import time

import pytest

from audit.models import AuditEvent
from audit.selectors import audit_chain_verify
from audit.services import Actor, audit_record, audited_atomic
from audit.sweeps import SEALER

DEADLINE_S = 10


@pytest.fixture
def sealer_thread(monkeypatch):
    """This process's sealer thread, as a server runs it (the suite keeps it off), stopped at the end."""
    monkeypatch.setattr(SEALER, "enabled", True)
    yield SEALER
    SEALER.stop()


def _sealed(pk):
    deadline = time.monotonic() + DEADLINE_S
    while (seq := AuditEvent.objects.filter(pk=pk).values_list("seq", flat=True).get()) is None:
        assert time.monotonic() < deadline, f"row {pk} not sealed within {DEADLINE_S} s"
        time.sleep(0.01)
    return seq


@pytest.mark.django_db(transaction=True)
def test_a_commit_wakes_the_sealer_thread_and_it_seals_the_rows(sealer_thread):
    actor = Actor.system("test")
    with audited_atomic():
        first = audit_record(actor=actor, action="job.submitted", target_type="job", target_id="j_1")
        second = audit_record(actor=actor, action="job.dispatched", target_type="job", target_id="j_1")

    assert (_sealed(first.pk), _sealed(second.pk)) == (1, 2)
    third = audit_record(actor=actor, action="job.cancel_requested", target_type="job", target_id="j_1")  # autocommit
    assert _sealed(third.pk) == 3
    report = audit_chain_verify()
    assert (report.intact, report.checked, report.unsealed) == (True, 3, 0)
