"""job_waiting_reason: the sentence an operator sees for a job that is still queued."""

from datetime import timedelta

import pytest
from django.utils import timezone

from job_queue.models import JobStatus, JobTarget
from job_queue.selectors import job_waiting_reason
from job_queue.tests.factories import JobFactory
from workers.models import WorkerStatus, WorkerType
from workers.tests.factories import WorkerFactory

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("status", [s for s in JobStatus.values if s != JobStatus.QUEUED])
def test_only_a_queued_job_has_a_waiting_reason(status):
    assert job_waiting_reason(JobFactory(status=status)) is None


def test_no_worker_registered():
    assert job_waiting_reason(JobFactory()) == "no worker is registered"


def test_no_local_worker_registered():
    WorkerFactory(worker_type=WorkerType.PERSISTENT)

    assert job_waiting_reason(JobFactory(target=JobTarget.LOCAL)) == "no local worker is registered"


def test_local_workers_do_not_count_for_a_worker_target():
    WorkerFactory(worker_type=WorkerType.LOCAL, gpu_count=8)

    assert job_waiting_reason(JobFactory(target=JobTarget.WORKER)) == "no worker is registered"


def test_not_enough_gpus_anywhere():
    WorkerFactory(gpu_count=2)
    WorkerFactory(gpu_count=1, offline=True)

    assert job_waiting_reason(JobFactory(gpu_count=8)) == "no worker has >= 8 GPUs (the most any has is 2)"


def test_no_label_match():
    WorkerFactory(gpu_count=4, labels={"gpu_type": "h100"})
    WorkerFactory(gpu_count=1, labels={"gpu_type": "a100"})

    reason = job_waiting_reason(JobFactory(gpu_count=2, worker_labels={"gpu_type": "a100*"}))

    assert reason == "no worker with >= 2 GPUs matches labels gpu_type=a100*"


def test_matching_workers_all_busy():
    WorkerFactory.create_batch(2, status=WorkerStatus.BUSY, labels={"gpu_type": "a100"})
    WorkerFactory(labels={"gpu_type": "h100"})  # idle, but does not match

    reason = job_waiting_reason(JobFactory(worker_labels={"gpu_type": "a100*"}))

    assert reason == "2 workers match but none is available (2 busy)"


def test_one_matching_worker_draining():
    WorkerFactory(draining=True)

    assert job_waiting_reason(JobFactory()) == "1 worker matches but none is available (1 draining)"


def test_unavailable_reasons_are_counted_by_state():
    WorkerFactory.create_batch(2, offline=True)
    WorkerFactory(stream_id=None)
    WorkerFactory(status=WorkerStatus.BUSY)

    reason = job_waiting_reason(JobFactory())

    assert reason.startswith("4 workers match but none is available (2 offline, ")
    assert "1 idle without an open stream" in reason
    assert "1 busy" in reason


def test_available_worker_means_dispatch_is_pending():
    WorkerFactory()

    assert job_waiting_reason(JobFactory()) == "1 matching worker idle; dispatch pending"


def test_earlier_jobs_of_equal_or_higher_priority_go_first():
    WorkerFactory.create_batch(2)
    start = timezone.now() - timedelta(minutes=10)
    JobFactory(priority=1, submitted_at=start)
    JobFactory(priority=0, submitted_at=start + timedelta(minutes=1))
    JobFactory(priority=-1, submitted_at=start + timedelta(minutes=2))  # lower priority: does not count
    job = JobFactory(priority=0, submitted_at=start + timedelta(minutes=3))

    assert job_waiting_reason(job) == "2 matching workers idle; 2 earlier job(s) go first"


def test_an_auto_job_with_labels_says_the_local_worker_does_not_match_them():
    WorkerFactory(worker_type=WorkerType.LOCAL, name="local@here", labels={})
    job = JobFactory(target=JobTarget.AUTO, worker_labels={"team": "vision"})
    reason = job_waiting_reason(job)
    assert reason.startswith("no worker with >= 0 GPUs matches labels team=vision; auto falls back to the local worker only")
    local_matches = JobFactory(target=JobTarget.AUTO, worker_labels={})
    assert "auto falls back" not in (job_waiting_reason(local_matches) or "")
