"""The admin index's fleet dashboard (issue 14.10): GPUs free and busy, the next job in line and why it
waits, stuck jobs flagged; the same fragment the page re-reads live."""

from datetime import timedelta

import pytest
from django.utils import timezone

from job_queue.models import Job, JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from simpletuner_site.admin_site import fleet_overview, stuck_jobs
from workers.models import Worker, WorkerStatus
from workers.tests.factories import UserFactory, WorkerFactory

pytestmark = pytest.mark.django_db


def test_gpus_free_and_busy_count_online_workers_only():
    WorkerFactory(gpu_count=4)  # idle with a stream: free
    busy = WorkerFactory(gpu_count=8, status=WorkerStatus.BUSY)
    job_on_worker(busy)
    WorkerFactory(gpu_count=2, stream_id=None)  # idle without a stream: not free
    WorkerFactory(gpu_count=16, offline=True)
    gpus = fleet_overview(UserFactory(is_superuser=True))["workers"]["gpus"]
    assert gpus == {"total": 14, "free": 4, "busy": 8}


def test_stuck_jobs_are_flagged_with_why(settings):
    now = timezone.now()
    silent = WorkerFactory(name="gpu-silent", status=WorkerStatus.BUSY)
    running = job_on_worker(silent)
    Worker.objects.filter(pk=silent.pk).update(last_heartbeat=now - timedelta(minutes=5))
    unacked = job_on_worker(WorkerFactory(name="gpu-mute", status=WorkerStatus.BUSY), status=JobStatus.DISPATCHED)
    Job.objects.filter(pk=unacked.pk).update(dispatched_at=now - timedelta(minutes=2))
    old = JobFactory(worker_labels={"team": "nobody"})
    Job.objects.filter(pk=old.pk).update(submitted_at=now - timedelta(minutes=30))
    JobFactory()  # queued a moment ago: not stuck

    flagged = {job.pk: why for job, why in stuck_jobs(now)}

    assert flagged[unacked.pk] == "dispatched to gpu-mute 2 min ago and not acknowledged"
    assert flagged[running.pk] == "its worker gpu-silent has been silent for 5 min"
    assert flagged[old.pk].startswith("queued for 30 min: no worker")
    assert len(flagged) == 3


def test_the_index_shows_the_dashboard_and_its_live_fragment(admin_client):
    waiting = JobFactory(config_name="next-one", worker_labels={"team": "x"})
    page = admin_client.get("/admin/").content.decode()
    fragment = admin_client.get("/admin/live/overview/").content.decode()
    for html in (page, fragment):
        assert 'id="fleet-gpus"' in html and 'id="fleet-stuck"' in html
        assert "Next in line:" in html and "next-one" in html
    assert waiting.pk in fragment or "next-one" in fragment


def _queued_long_ago(count, now):
    jobs = [JobFactory(worker_labels={"team": f"t{n}"}) for n in range(count)]
    Job.objects.filter(pk__in=[job.pk for job in jobs]).update(submitted_at=now - timedelta(minutes=30))
    return jobs


def test_the_stuck_list_reads_the_fleet_once_whatever_the_number_of_waiting_jobs():
    """Each queued job's reason is worked out from one read of the workers (10,000 of them on a big fleet)."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    now = timezone.now()
    WorkerFactory.create_batch(3)
    _queued_long_ago(1, now)
    with CaptureQueriesContext(connection) as one:
        assert len(stuck_jobs(now)) == 1
    _queued_long_ago(4, now)
    with CaptureQueriesContext(connection) as five:
        flagged = stuck_jobs(now)

    assert len(flagged) == 5 and all("matches labels team=t" in why for _, why in flagged)
    assert len(five) == len(one)
