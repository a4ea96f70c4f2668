"""Events reach django-eventstream's storage only when the transaction that caused them commits."""

import pytest
from django.db import transaction

from audit.services import Actor
from job_queue.models import JobStatus
from job_queue.services import job_cancel, job_submit
from job_queue.tests.factories import JobFactory, job_on_worker
from common.errors import Conflict
from worker_agent import protocol
from workers import events
from workers.models import Worker, WorkerStatus
from workers.services import worker_drain
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows, sent_events

ACTOR = Actor.system("test")


class Boom(Exception):
    pass


@pytest.mark.django_db
def test_publish_on_commit_stores_the_event_on_the_worker_channel_with_its_type(commit):
    with commit():
        events.publish_on_commit("w_abc", protocol.SHUTDOWN, reason="maintenance")

    assert sent_events() == [
        {"channel": "worker-w_abc", "type": "shutdown", "data": {"type": "shutdown", "reason": "maintenance"}}
    ]


@pytest.mark.django_db
def test_events_of_a_rolled_back_transaction_are_never_stored(commit):
    worker = WorkerFactory()
    job = job_on_worker(worker)

    with commit() as callbacks:
        with pytest.raises(Boom), transaction.atomic():
            worker_drain(worker_id=worker.pk, actor=ACTOR)
            job_cancel(job_id=job.pk, actor=ACTOR)
            raise Boom

    assert callbacks == []
    assert sent_events() == []
    assert audit_rows() == []
    worker.refresh_from_db()
    job.refresh_from_db()
    assert (worker.status, worker.drain_requested_at, job.status) == (WorkerStatus.BUSY, None, JobStatus.RUNNING)


@pytest.mark.django_db
def test_a_refused_service_call_sends_nothing(commit):
    job = JobFactory(status=JobStatus.COMPLETED)

    with commit(), pytest.raises(Conflict):
        job_cancel(job_id=job.pk, actor=ACTOR)

    assert sent_events() == []


@pytest.mark.django_db(transaction=True)
def test_real_commit_stores_events_and_real_rollback_stores_none():
    """No captured callbacks here: the database really commits (or rolls back)."""
    drained = WorkerFactory()
    kept = WorkerFactory()

    with pytest.raises(Boom), transaction.atomic():
        worker_drain(worker_id=kept.pk, actor=ACTOR)
        raise Boom
    worker_drain(worker_id=drained.pk, actor=ACTOR)

    assert sent_events() == [
        {"channel": f"worker-{drained.pk}", "type": "drain", "data": {"type": "drain", "current_job_id": None}}
    ]
    assert Worker.objects.get(pk=kept.pk).status == WorkerStatus.IDLE


@pytest.mark.django_db(transaction=True)
def test_submit_in_a_real_transaction_sends_one_job_submit():
    worker = WorkerFactory()

    job, dispatched = job_submit(config_name="c", config={"lr": 1e-4}, actor=ACTOR)

    assert dispatched
    (event,) = sent_events(worker.pk)
    assert (event["type"], event["data"]["job_id"], event["data"]["config"]) == ("job_submit", job.pk, {"lr": 1e-4})
    assert event["data"]["attempt"] == job.lease_id


@pytest.mark.django_db(transaction=True)
def test_submit_inside_a_transaction_that_rolls_back_sends_nothing():
    WorkerFactory()

    with pytest.raises(Boom), transaction.atomic():
        job_submit(config_name="c", actor=ACTOR)
        raise Boom

    assert sent_events() == []
    assert Worker.objects.get().status == WorkerStatus.IDLE
