"""Dispatch: which queued job goes to which available worker, and what goes out when it does."""

from datetime import timedelta

import pytest
from django.utils import timezone

from artifacts.tokens import upload_token
from audit import actions
from audit.services import Actor
from job_queue.models import JobAttempt, JobStatus, JobTarget
from job_queue.dispatch import dispatch_for_job, dispatch_for_worker, dispatch_pending
from job_queue.services import job_submit
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import OFFER_RANK_LOCAL, Worker, WorkerStatus, WorkerType
from workers.tests.factories import UserFactory, WorkerFactory
from workers.tests.support import audit_rows, sent_events

pytestmark = pytest.mark.django_db


@pytest.fixture
def operator_actor():
    return Actor.for_user(UserFactory(username="alice"), "10.0.0.5")


def _status(obj):
    obj.refresh_from_db()
    return obj.status


def test_dispatch_assigns_the_job_records_the_attempt_and_sends_job_submit(commit):
    job = JobFactory(config={"model_type": "lora", "num_processes": 1}, dataloader=[{"id": "pics"}])
    worker = WorkerFactory()

    with commit():
        assert dispatch_for_job(job.pk) == worker

    job.refresh_from_db()
    worker.refresh_from_db()
    assert job.status == JobStatus.DISPATCHED
    assert (job.worker_id, job.worker_name, job.attempt_count) == (worker.pk, worker.name, 1)
    assert job.lease_id and job.dispatched_at
    assert (worker.status, worker.current_job_id) == (WorkerStatus.BUSY, job.pk)
    (attempt,) = JobAttempt.objects.filter(job=job)
    assert (attempt.number, attempt.lease_id, attempt.worker_id, attempt.outcome) == (1, job.lease_id, worker.pk, "")
    assert sent_events() == [
        {
            "channel": f"worker-{worker.pk}",
            "type": "job_submit",
            "data": {
                "type": "job_submit",
                "job_id": job.pk,
                "config_name": job.config_name,
                "config": {"model_type": "lora", "num_processes": 1},
                "dataloader": [{"id": "pics"}],
                "upload_endpoint": "/api/cloud/storage",
                "upload_token": upload_token(job.lease_id),
                "attempt": job.lease_id,
                "attempt_number": 1,
                "resume": None,
            },
        }
    ]
    (dispatched,) = audit_rows(actions.JOB_DISPATCHED)
    assert dispatched.details == {"worker": worker.pk, "worker_name": worker.name, "attempt": 1, "lease": job.lease_id}
    assert [r.details["to"] for r in audit_rows(actions.JOB_STATUS_CHANGED)] == [JobStatus.DISPATCHED]
    assert [r.details["to"] for r in audit_rows(actions.WORKER_STATUS_CHANGED)] == [WorkerStatus.BUSY]


def test_no_event_goes_out_before_commit(django_capture_on_commit_callbacks, pushed):
    job = JobFactory()
    worker = WorkerFactory()

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        dispatch_for_job(job.pk)

    assert callbacks, "job_submit must be published on commit"
    assert pushed == []  # nothing at all: neither the job_submit nor the operators' change feed
    # stored in the dispatch's own transaction, so it commits (or rolls back) with the dispatch
    assert [e["data"]["job_id"] for e in sent_events(worker.pk)] == [job.pk]
    for callback in callbacks:
        callback()
    assert [(channel, event.type) for channel, event in pushed if channel.startswith("worker-")] == [
        (f"worker-{worker.pk}", "job_submit")
    ]


def test_worker_takes_highest_priority_then_oldest_job(commit):
    start = timezone.now() - timedelta(hours=1)
    JobFactory(priority=0, submitted_at=start)
    JobFactory(priority=5, submitted_at=start + timedelta(minutes=2))
    urgent_oldest = JobFactory(priority=5, submitted_at=start + timedelta(minutes=1))
    worker = WorkerFactory()

    with commit():
        assert dispatch_for_worker(worker.pk) == urgent_oldest

    assert [e["data"]["job_id"] for e in sent_events(worker.pk)] == [urgent_oldest.pk]


def test_dispatch_pending_sends_jobs_in_priority_then_fifo_order_while_workers_last(commit):
    start = timezone.now() - timedelta(hours=1)
    low = JobFactory(priority=0, submitted_at=start)
    high_late = JobFactory(priority=5, submitted_at=start + timedelta(minutes=2))
    high_early = JobFactory(priority=5, submitted_at=start + timedelta(minutes=1))
    mid = JobFactory(priority=1, submitted_at=start + timedelta(minutes=3))
    WorkerFactory.create_batch(3)

    with commit():
        assert dispatch_pending() == 3

    assert [e["data"]["job_id"] for e in sent_events()] == [high_early.pk, high_late.pk, mid.pk]
    assert _status(low) == JobStatus.QUEUED


def test_dispatch_pending_without_available_workers_sends_nothing():
    JobFactory()
    WorkerFactory(status=WorkerStatus.BUSY)

    assert dispatch_pending() == 0
    assert sent_events() == []


UNAVAILABLE = {
    "busy": dict(status=WorkerStatus.BUSY),
    "idle without stream": dict(stream_id=None),
    "draining": dict(draining=True),
    "offline": dict(offline=True),
    "never connected": dict(fresh=True, gpu_count=8),
    "local worker": dict(worker_type=WorkerType.LOCAL),
    "too few GPUs": dict(gpu_count=1),
    "label mismatch": dict(labels={"gpu_type": "h100"}),
    "label missing": dict(labels={"team": "nlp"}),
}


@pytest.mark.parametrize("worker_kwargs", UNAVAILABLE.values(), ids=UNAVAILABLE.keys())
def test_job_goes_only_to_an_idle_streaming_worker_that_fits(worker_kwargs, commit):
    job = JobFactory(gpu_count=2, worker_labels={"gpu_type": "a100*"})
    worker = WorkerFactory(**{"gpu_count": 2, "labels": {"gpu_type": "a100"}, **worker_kwargs})
    status_before = worker.status

    with commit():
        assert dispatch_for_job(job.pk) is None
        assert dispatch_for_worker(worker.pk) is None
        assert dispatch_pending() == 0

    assert _status(job) == JobStatus.QUEUED
    assert (_status(worker), worker.current_job_id) == (status_before, None)
    assert JobAttempt.objects.count() == 0
    assert sent_events() == []
    assert audit_rows(actions.JOB_DISPATCHED) == []


def test_the_one_worker_that_fits_gets_the_job(commit):
    job = JobFactory(gpu_count=2, worker_labels={"gpu_type": "a100*", "team": "nlp"})
    for kwargs in UNAVAILABLE.values():
        WorkerFactory(**{"gpu_count": 2, "labels": {"gpu_type": "a100", "team": "nlp"}, **kwargs})
    fitting = WorkerFactory(gpu_count=4, labels={"gpu_type": "a100-80g", "team": "nlp", "site": "a"})

    with commit():
        assert dispatch_for_job(job.pk) == fitting

    assert [e["channel"] for e in sent_events()] == [f"worker-{fitting.pk}"]


def test_a_draining_worker_gets_nothing_even_when_asked_directly():
    JobFactory()
    worker = WorkerFactory(draining=True)

    assert dispatch_for_worker(worker.pk) is None
    # Even an idle row with a drain request (never produced by the services) is refused.
    Worker.objects.filter(pk=worker.pk).update(status=WorkerStatus.IDLE)
    assert dispatch_for_worker(worker.pk) is None
    assert sent_events() == []


def test_a_worker_holding_a_job_gets_no_second_one():
    worker = WorkerFactory()
    job_on_worker(worker, status=JobStatus.DISPATCHED)
    Worker.objects.filter(pk=worker.pk).update(status=WorkerStatus.IDLE)  # an inconsistent row must still be safe
    queued = JobFactory()

    assert dispatch_for_worker(worker.pk) is None
    assert dispatch_for_job(queued.pk) is None
    assert _status(queued) == JobStatus.QUEUED


def test_a_job_that_is_no_longer_queued_is_not_dispatched():
    job = JobFactory(status=JobStatus.CANCELLED)
    WorkerFactory()

    assert dispatch_for_job(job.pk) is None
    assert sent_events() == []


def test_worker_target_never_goes_to_a_local_worker():
    job = JobFactory(target=JobTarget.WORKER)
    local = WorkerFactory(worker_type=WorkerType.LOCAL)

    assert dispatch_for_job(job.pk) is None
    assert dispatch_for_worker(local.pk) is None
    assert _status(job) == JobStatus.QUEUED


def test_local_target_goes_only_to_the_local_worker():
    job = JobFactory(target=JobTarget.LOCAL)
    remote = WorkerFactory(worker_type=WorkerType.PERSISTENT)

    assert dispatch_for_worker(remote.pk) is None
    local = WorkerFactory(worker_type=WorkerType.LOCAL)
    assert dispatch_for_job(job.pk) == local


def test_auto_target_prefers_a_remote_worker_and_falls_back_to_local():
    local = WorkerFactory(worker_type=WorkerType.LOCAL, last_job_finished_at=None)
    remote = WorkerFactory(worker_type=WorkerType.EPHEMERAL, last_job_finished_at=timezone.now())

    assert dispatch_for_job(JobFactory(target=JobTarget.AUTO).pk) == remote
    assert dispatch_for_job(JobFactory(target=JobTarget.AUTO).pk) == local


def test_least_recently_used_worker_goes_first():
    now = timezone.now()
    recent = WorkerFactory(last_job_finished_at=now)
    older = WorkerFactory(last_job_finished_at=now - timedelta(hours=1))
    never = WorkerFactory(last_job_finished_at=None)

    assigned = [dispatch_for_job(JobFactory().pk) for _ in range(3)]

    assert assigned == [never, older, recent]


def test_an_auto_job_is_offered_remote_workers_then_local_each_never_used_then_least_recently_used():
    now = timezone.now()
    made = {
        "local recent": WorkerFactory(worker_type=WorkerType.LOCAL, last_job_finished_at=now),
        "remote recent": WorkerFactory(worker_type=WorkerType.PERSISTENT, last_job_finished_at=now),
        "local never": WorkerFactory(worker_type=WorkerType.LOCAL, last_job_finished_at=None),
        "remote older": WorkerFactory(worker_type=WorkerType.EPHEMERAL, last_job_finished_at=now - timedelta(hours=1)),
        "remote never": WorkerFactory(worker_type=WorkerType.EPHEMERAL, last_job_finished_at=None),
        "local older": WorkerFactory(worker_type=WorkerType.LOCAL, last_job_finished_at=now - timedelta(hours=1)),
    }
    names = {worker.pk: name for name, worker in made.items()}

    assigned = [names[dispatch_for_job(JobFactory(target=JobTarget.AUTO).pk).pk] for _ in made]

    assert assigned == ["remote never", "remote older", "remote recent", "local never", "local older", "local recent"]


def test_a_workers_offer_rank_follows_its_type_and_its_first_finished_job():
    remote, local = WorkerFactory(worker_type=WorkerType.PERSISTENT), WorkerFactory(worker_type=WorkerType.LOCAL)
    both = Worker.objects.filter(pk__in=[remote.pk, local.pk])

    assert dict(both.values_list("pk", "offer_rank")) == {remote.pk: 0, local.pk: OFFER_RANK_LOCAL}
    both.update(last_job_finished_at=timezone.now())
    assert dict(both.values_list("pk", "offer_rank")) == {remote.pk: 1, local.pk: OFFER_RANK_LOCAL + 1}


def test_gpu_count_zero_means_any_worker_even_one_without_gpus():
    cpu_only = WorkerFactory(gpu_count=0, accelerator_type="cpu")

    assert dispatch_for_job(JobFactory(gpu_count=0).pk) == cpu_only


def test_submit_dispatches_at_once_when_a_worker_fits(commit, operator_actor):
    worker = WorkerFactory(gpu_count=2)

    with commit():
        job, dispatched = job_submit(config_name="cfg", config={"num_processes": 2}, actor=operator_actor)

    assert dispatched is True
    assert (job.status, job.gpu_count, job.worker_id) == (JobStatus.DISPATCHED, 2, worker.pk)
    assert [e["type"] for e in sent_events(worker.pk)] == ["job_submit"]
    (submitted,) = audit_rows(actions.JOB_SUBMITTED, target_id=job.pk)
    assert (submitted.actor_type, submitted.actor_name, submitted.client_ip) == ("user", "alice", "10.0.0.5")
    assert job.submitted_by.username == "alice"


def test_submit_queues_when_nothing_fits(commit, operator_actor):
    WorkerFactory(gpu_count=1)

    with commit():
        job, dispatched = job_submit(config_name="cfg", gpu_count=4, actor=operator_actor)

    assert dispatched is False
    assert job.status == JobStatus.QUEUED
    assert sent_events() == []


def test_job_on_an_ephemeral_worker_is_dispatched_like_any_remote_one():
    worker = WorkerFactory(worker_type=WorkerType.EPHEMERAL)

    assert dispatch_for_worker(worker.pk) is None
    job = JobFactory()
    assert dispatch_for_worker(worker.pk) == job
