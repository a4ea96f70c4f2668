"""Writers and sealers on real PostgreSQL at once: one chain, never forked, every committed row sealed, in commit order."""

import threading

import pytest
from django.contrib.auth import get_user_model
from django.db import connection, transaction

from audit.models import AuditChainHead, AuditEvent
from audit.selectors import audit_chain_verify
from audit.services import Actor, audit_record, audited_atomic
from audit.sweeps import seal_chain
from job_queue.services import job_cancel, job_submit
from job_queue.sweeps import sweep_stale_workers
from job_queue.tests.test_concurrency import DEADLINE_S, run_concurrently
from workers.services import worker_create, worker_drain

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

WRITERS = 4
SEALERS = 2
ROUNDS = 15
ACTOR = Actor.system("test")


def writer(index, finished):
    """Drive real services that lock workers and jobs and write audit rows, in one transaction each."""
    user = get_user_model().objects.create_user(username=f"operator-{index}")

    def run():
        actor = Actor.for_user(user, f"10.0.0.{index}")
        try:
            for n in range(ROUNDS):
                worker, _token = worker_create(name=f"w-{index}-{n}", labels={"writer": str(index)}, actor=actor)
                worker_drain(worker_id=worker.pk, actor=actor)
                job, _dispatched = job_submit(config_name=f"c-{index}-{n}", config={"lr": 0.1, "steps": 1.0}, actor=actor)
                job_cancel(job_id=job.pk, actor=actor)
                sweep_stale_workers()
        finally:
            finished()
        return ROUNDS

    return run


def sealer(writing_done):
    """Seal in small passes while the writers write (many turns, taken while the others wait); return how many it sealed."""

    def run():
        sealed = 0
        while not writing_done.wait(0.005):  # a pass every few ms, not a busy loop on the two cores
            sealed += seal_chain(batch=7)["sealed"]
        return sealed

    return run


def test_concurrent_writers_and_sealers_make_one_intact_chain_of_every_row(postgres_url):
    writing_done, left, guard = threading.Event(), [WRITERS], threading.Lock()

    def finished():
        with guard:
            left[0] -= 1
            if not left[0]:
                writing_done.set()

    results = run_concurrently([writer(i, finished) for i in range(WRITERS)] + [sealer(writing_done) for _ in range(SEALERS)])
    last = seal_chain()["sealed"]  # what committed after the sealers' last look

    count = AuditEvent.objects.count()
    assert count >= WRITERS * ROUNDS * 4
    assert sum(results[WRITERS:]) + last == count  # each row sealed once, by one sealer
    assert list(AuditEvent.objects.order_by("seq").values_list("seq", flat=True)) == list(range(1, count + 1))
    assert AuditChainHead.objects.get().seq == count
    report = audit_chain_verify()
    assert report.intact, report.faults
    assert (report.checked, report.unsealed) == (count, 0)


def test_a_row_with_a_lower_id_committed_after_a_pass_is_sealed_by_the_next_after_the_rows_before_it(postgres_url):
    """The ordering trap: ids are handed out at INSERT, so a transaction holding a lower id can commit after
    one holding a higher id has committed and been sealed. Its row is sealed by the next pass, not skipped."""
    inserted, commit_now = threading.Event(), threading.Event()
    held = {}

    def late_writer():
        try:
            with transaction.atomic():
                held["row"] = audit_record(actor=ACTOR, action="job.submitted", target_type="job", target_id="j_late")
                inserted.set()
                assert commit_now.wait(DEADLINE_S)
        finally:
            connection.close()

    late = threading.Thread(target=late_writer, daemon=True)
    late.start()
    try:
        assert inserted.wait(DEADLINE_S)
        early = audit_record(actor=ACTOR, action="job.submitted", target_type="job", target_id="j_early")
        assert held["row"].pk < early.pk  # the late row holds the lower id

        assert seal_chain() == {"sealed": 1}  # the early row; the late one is not committed yet
        assert AuditEvent.objects.get(pk=early.pk).seq == 1
        report = audit_chain_verify()
        assert (report.intact, report.checked, report.unsealed) == (True, 1, 0)  # the open row is not visible
    finally:
        commit_now.set()
        late.join(DEADLINE_S)

    assert audit_chain_verify().unsealed == 1
    assert seal_chain() == {"sealed": 1}
    assert dict(AuditEvent.objects.values_list("target_id", "seq")) == {"j_early": 1, "j_late": 2}
    report = audit_chain_verify()
    assert (report.intact, report.checked, report.unsealed) == (True, 2, 0)
