"""Several writers on real PostgreSQL row locks at once: one chain, never forked, never deadlocked."""

import pytest
from django.contrib.auth import get_user_model

from audit.models import AuditChainHead, AuditEvent
from audit.selectors import audit_chain_verify
from audit.services import Actor
from job_queue.services import job_cancel, job_submit
from job_queue.sweeps import sweep_stale_workers
from job_queue.tests.test_concurrency import run_concurrently
from workers.services import worker_create, worker_drain

pytestmark = [pytest.mark.postgres, pytest.mark.django_db(transaction=True)]

WRITERS = 4
ROUNDS = 15


def writer(index):
    """Drive real services that lock workers and jobs, then append to the chain, in one transaction each."""
    user = get_user_model().objects.create_user(username=f"operator-{index}")

    def run():
        actor = Actor.for_user(user, f"10.0.0.{index}")
        for n in range(ROUNDS):
            worker, _token = worker_create(name=f"w-{index}-{n}", labels={"writer": str(index)}, actor=actor)
            worker_drain(worker_id=worker.pk, actor=actor)
            job, _dispatched = job_submit(config_name=f"c-{index}-{n}", config={"lr": 0.1, "steps": 1.0}, actor=actor)
            job_cancel(job_id=job.pk, actor=actor)
            sweep_stale_workers()
        return ROUNDS

    return run


def test_concurrent_writers_extend_one_intact_chain(postgres_url):
    run_concurrently([writer(i) for i in range(WRITERS)])

    count = AuditEvent.objects.count()
    assert count >= WRITERS * ROUNDS * 4
    assert list(AuditEvent.objects.order_by("seq").values_list("seq", flat=True)) == list(range(1, count + 1))
    assert AuditChainHead.objects.get().seq == count
    report = audit_chain_verify()
    assert report.intact, report.faults
    assert report.checked == count
