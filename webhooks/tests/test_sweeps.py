"""The trim of old deliveries: ended ones go 30 days after they ended, with their attempts; pending ones never."""

from datetime import timedelta

import pytest
from django.utils import timezone

from audit.services import Actor
from job_queue.services import job_cancel
from job_queue.tests.factories import JobFactory

from .. import sender, sweeps, tasks
from ..client import Answer
from ..models import Delivery, DeliveryAttempt

pytestmark = pytest.mark.django_db


def test_ended_deliveries_are_trimmed_after_their_retention_with_their_attempts_and_pending_ones_kept(make_webhook):
    make_webhook(events=["job.cancelled"])
    for _ in range(3):
        job_cancel(job_id=JobFactory().pk, actor=Actor.system("test"))
    answers = iter([Answer(status_code=200), Answer(status_code=404), Answer(status_code=500)])
    sender.deliver_due(post=lambda url, body, headers: next(answers))
    old = timezone.now() - sweeps.RETENTION - timedelta(minutes=1)
    Delivery.objects.exclude(status="pending").update(finished_at=old)
    Delivery.objects.filter(status="pending").update(created_at=old)  # pending: kept however old

    assert sweeps.trim_deliveries() == {"deliveries": 2}

    (kept,) = Delivery.objects.all()
    assert kept.status == "pending"
    assert list(DeliveryAttempt.objects.values_list("delivery_id", flat=True)) == [kept.pk]
    assert tasks.trim_deliveries() == {"deliveries": 0}


def test_a_recent_ended_delivery_is_kept(make_webhook):
    make_webhook(events=["job.cancelled"])
    job_cancel(job_id=JobFactory().pk, actor=Actor.system("test"))
    sender.deliver_due(post=lambda url, body, headers: Answer(status_code=200))

    assert sweeps.trim_deliveries() == {"deliveries": 0}
    assert Delivery.objects.count() == 1
