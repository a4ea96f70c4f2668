"""Deliveries are written in the transaction of the change that causes them, set-based, and only for subscribers."""

import json
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from audit.services import Actor
from job_queue.api.serializers import JobSerializer
from job_queue.agents import worker_disconnect
from job_queue.models import Job, JobStatus
from job_queue.reports import job_report
from job_queue.services import job_cancel
from job_queue.sweeps import sweep_stale_workers
from job_queue.tests.factories import JobFactory, job_on_worker
from workers.models import Worker, WorkerStatus
from workers.tests.factories import WorkerFactory

from .. import sender
from ..models import Delivery

pytestmark = pytest.mark.django_db
SYSTEM = Actor.system("test")


def bodies(**filters):
    return [json.loads(d.body) for d in Delivery.objects.filter(**filters).order_by("seq")]


def test_a_cancelled_job_has_its_delivery_written_before_the_commit_and_sent_after(make_webhook, django_capture_on_commit_callbacks, monkeypatch):
    hook = make_webhook(events=["job.cancelled"])
    job = JobFactory()
    woken = []
    monkeypatch.setattr(sender.SENDER, "wake", lambda: woken.append(True))

    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        job_cancel(job_id=job.pk, actor=SYSTEM)
        (delivery,) = Delivery.objects.all()  # in the transaction itself, before any commit callback
        assert not woken

    for callback in callbacks:
        callback()
    assert woken  # the sender is kicked once it is committed
    body = json.loads(delivery.body)
    assert set(body) == {"id", "event", "occurred_at", "data"}
    assert (body["id"], body["event"], delivery.webhook_id, delivery.subject) == (delivery.delivery_id, "job.cancelled", hook.pk, f"job:{job.pk}")
    assert body["occurred_at"].endswith("Z") and body["data"] == json.loads(json.dumps(JobSerializer(Job.objects.get(pk=job.pk)).data))
    assert body["data"]["status"] == "cancelled"


def test_a_rolled_back_change_writes_no_delivery(make_webhook):
    make_webhook()
    job = JobFactory()

    with pytest.raises(RuntimeError), transaction.atomic():
        job_cancel(job_id=job.pk, actor=SYSTEM)
        assert Delivery.objects.count() == 1
        raise RuntimeError("the caller's transaction fails after the change")

    assert Job.objects.get(pk=job.pk).status == JobStatus.QUEUED
    assert not Delivery.objects.exists()


def test_only_active_webhooks_subscribed_to_the_event_get_a_delivery(make_webhook):
    failed_only = make_webhook(events=["job.failed"])
    cancelled = make_webhook(events=["job.cancelled"])
    make_webhook(events=["job.cancelled"], active=False)

    job_cancel(job_id=JobFactory().pk, actor=SYSTEM)

    assert list(Delivery.objects.values_list("webhook_id", flat=True)) == [cancelled.pk]
    assert not failed_only.deliveries.exists()


def test_a_completed_and_a_failed_report_and_a_disconnect(make_webhook):
    make_webhook()
    worker = WorkerFactory(status=WorkerStatus.BUSY)
    done = job_on_worker(worker)
    job_report(worker_id=worker.pk, job_id=done.pk, data={"status": "completed", "attempt": done.lease_id}, actor=Actor.for_worker(worker))
    other = WorkerFactory(status=WorkerStatus.BUSY)
    broken = job_on_worker(other, max_retries=0)
    job_report(worker_id=other.pk, job_id=broken.pk, data={"status": "failed", "error": "CUDA OOM", "attempt": broken.lease_id}, actor=Actor.for_worker(other))
    worker_disconnect(worker_id=other.pk, actor=Actor.for_worker(other))

    assert [(b["event"], b["data"]["id"], b["data"]["status"]) for b in bodies()] == [
        ("job.completed", done.pk, "completed"),
        ("job.failed", broken.pk, "failed"),
        ("worker.offline", other.pk, "offline"),
    ]
    assert bodies()[1]["data"]["last_error"].startswith("CUDA OOM")


def test_a_slack_webhook_gets_a_line_of_text(make_webhook):
    make_webhook(events=["job.cancelled"], format="slack", url="https://hooks.slack.com/services/T/B/X")
    job = JobFactory(config_name="sdxl-lora")

    job_cancel(job_id=job.pk, actor=SYSTEM)

    assert bodies() == [{"text": f"Job {job.pk} (sdxl-lora) was cancelled"}]


def _stale_fleet(size):
    old = timezone.now() - timedelta(hours=1)
    workers = [WorkerFactory(status=WorkerStatus.BUSY, last_heartbeat=old) for _ in range(size)]
    return [job_on_worker(w, max_retries=3) for w in workers]


def _sweep_queries():
    with CaptureQueriesContext(connection) as queries:
        sweep_stale_workers()
    return [q["sql"] for q in queries.captured_queries if "webhooks_" in q["sql"]]


def test_a_sweep_writes_its_deliveries_set_based_whatever_its_size(make_webhook):
    make_webhook(events=["job.requeued", "worker.offline"])
    make_webhook(events=["job.requeued"])
    _stale_fleet(2)
    small = _sweep_queries()
    Delivery.objects.all().delete()
    jobs = _stale_fleet(12)

    large = _sweep_queries()

    assert len(large) == len(small) <= 4, large  # the webhooks read and one INSERT per topic
    requeued = {b["data"]["id"] for b in bodies(event="job.requeued")}
    assert requeued == {j.pk for j in jobs} and Delivery.objects.filter(event="job.requeued").count() == 24
    assert Delivery.objects.filter(event="worker.offline").count() == 12
    assert set(Worker.objects.filter(status=WorkerStatus.OFFLINE).values_list("pk", flat=True)) >= {j.worker_id for j in jobs if j.worker_id}


def test_the_objects_url_is_absolute_under_the_public_url(make_webhook, settings):
    settings.PUBLIC_URL = "https://orchestrator.example.com"
    make_webhook(events=["job.cancelled"])
    job = JobFactory()

    job_cancel(job_id=job.pk, actor=SYSTEM)

    assert bodies()[0]["data"]["url"] == f"https://orchestrator.example.com/api/queue/{job.pk}"
