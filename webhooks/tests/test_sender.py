"""The sender: signed POSTs, retries with backoff (the same delivery id), what is not retried, order, leases."""

import hashlib
import hmac
import json
import threading
from datetime import timedelta

import pytest
from django.db import connection
from django.utils import timezone

from audit.services import Actor
from common.errors import ServiceError
from job_queue.services import job_cancel
from job_queue.tests.factories import JobFactory

from .. import sender, services
from ..client import Answer
from ..models import Delivery, DeliveryAttempt, DeliveryStatus

pytestmark = pytest.mark.django_db
SYSTEM = Actor.system("test")


class Receiver:
    """A fake ``client.post``: answers each call with the next of ``answers`` (the last one again when they run out)."""

    def __init__(self, *answers):
        self.answers = list(answers) or [Answer(status_code=200)]
        self.calls = []

    def __call__(self, url, body, headers):
        self.calls.append((url, body, headers))
        return self.answers[min(len(self.calls), len(self.answers)) - 1]


def due_now():
    """Make every pending delivery due (as if its backoff had passed)."""
    Delivery.objects.filter(status=DeliveryStatus.PENDING).update(next_attempt_at=timezone.now() - timedelta(seconds=1))


def one_delivery(make_webhook, **fields):
    make_webhook(events=["job.cancelled"], **fields)
    job_cancel(job_id=JobFactory().pk, actor=SYSTEM)
    return Delivery.objects.get()


def test_a_delivery_is_posted_signed_and_recorded(make_webhook):
    delivery = one_delivery(make_webhook, secret="a-very-secret-key")
    receiver = Receiver(Answer(status_code=204, duration_ms=12))

    assert sender.deliver_due(post=receiver) == {"delivered": 1, "retrying": 0, "failed": 0}

    ((url, body, headers),) = receiver.calls
    assert url == "https://hooks.example.com/simpletuner" and body == delivery.body.encode()
    expected = "sha256=" + hmac.new(b"a-very-secret-key", body, hashlib.sha256).hexdigest()
    assert headers["X-SimpleTuner-Signature"] == expected
    assert headers["X-SimpleTuner-Event"] == "job.cancelled" and headers["X-SimpleTuner-Delivery"] == delivery.delivery_id
    assert json.loads(body)["id"] == delivery.delivery_id
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_status_code, delivery.next_attempt_at) == ("delivered", 1, 204, None)
    assert list(DeliveryAttempt.objects.values_list("number", "status_code", "outcome", "duration_ms")) == [(1, 204, "delivered", 12)]
    assert sender.deliver_due(post=receiver) == {"delivered": 0, "retrying": 0, "failed": 0}  # nothing is sent twice


@pytest.mark.parametrize(
    "answer",
    [Answer(status_code=500), Answer(status_code=503), Answer(status_code=408), Answer(status_code=429), Answer(error="connection refused")],
)
def test_a_5xx_408_429_or_network_error_is_retried_with_the_same_delivery_id(make_webhook, answer):
    delivery = one_delivery(make_webhook)
    receiver = Receiver(answer, Answer(status_code=200))
    before = timezone.now()

    assert sender.deliver_due(post=receiver)["retrying"] == 1
    delivery.refresh_from_db()
    assert delivery.status == "pending"
    assert before + timedelta(seconds=9) < delivery.next_attempt_at < timezone.now() + timedelta(seconds=30)  # first retry in 30 s
    assert sender.deliver_due(post=receiver)["retrying"] == 0  # not due yet
    due_now()
    assert sender.deliver_due(post=receiver)["delivered"] == 1

    ids = {headers["X-SimpleTuner-Delivery"] for _url, _body, headers in receiver.calls}
    assert ids == {delivery.delivery_id} and len(receiver.calls) == 2 and len({b for _u, b, _h in receiver.calls}) == 1
    assert list(DeliveryAttempt.objects.order_by("number").values_list("outcome", flat=True)) == ["retry", "delivered"]


@pytest.mark.parametrize("answer", [Answer(status_code=404), Answer(status_code=400), Answer(status_code=301), Answer(error="10.0.0.1 is a private address", refused=True)])
def test_a_4xx_a_redirect_or_a_refused_address_is_not_retried(make_webhook, answer):
    delivery = one_delivery(make_webhook)
    receiver = Receiver(answer)

    assert sender.deliver_due(post=receiver)["failed"] == 1
    due_now()
    assert sender.deliver_due(post=receiver)["failed"] == 0
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, len(receiver.calls)) == ("failed", 1, 1)


def test_the_backoff_doubles_up_to_an_hour_with_jitter_and_honours_retry_after():
    delays = [services.retry_delay(n, rand=lambda: 0.0) for n in range(1, 20)]
    assert delays[:4] == [10, 20, 40, 80] and max(delays) == 3600
    assert 14.9 < services.retry_delay(1, rand=lambda: 0.999) < 15
    assert services.retry_delay(1, retry_after=120, rand=lambda: 0.0) == 120
    assert services.retry_delay(1, retry_after=10**9, rand=lambda: 0.0) == 3600


def test_a_delivery_is_retried_until_its_window_of_24_hours_is_over(make_webhook):
    delivery = one_delivery(make_webhook)
    assert delivery.retry_until - delivery.occurred_at == timedelta(hours=24)
    receiver = Receiver(Answer(status_code=502))
    sender.deliver_due(post=receiver)
    Delivery.objects.filter(pk=delivery.pk).update(retry_until=timezone.now() - timedelta(seconds=1))
    due_now()

    assert sender.deliver_due(post=receiver)["failed"] == 1
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("failed", 2)


def test_one_subjects_deliveries_are_sent_in_order_never_past_a_pending_one(make_webhook):
    make_webhook(events=["job.requeued", "job.cancelled"])
    first, second = Delivery(), Delivery()
    job = JobFactory()
    job_cancel(job_id=job.pk, actor=SYSTEM)
    other = JobFactory()
    job_cancel(job_id=other.pk, actor=SYSTEM)
    # a later event of the first job (made by hand: a cancelled job does not change again)
    first = Delivery.objects.get(subject=f"job:{job.pk}")
    later = Delivery.objects.create(
        webhook=first.webhook, event="job.requeued", subject=first.subject, occurred_at=first.occurred_at,
        body='{"n": 2}', next_attempt_at=first.next_attempt_at, retry_until=first.retry_until,
    )  # fmt: skip
    receiver = Receiver(Answer(status_code=500), Answer(status_code=200))

    sender.deliver_due(post=receiver)  # the first job's first delivery fails; the other job's goes through

    sent = [json.loads(body).get("n") or json.loads(body)["data"]["id"] for _url, body, _h in receiver.calls]
    assert sent == [job.pk, other.pk]  # not the first job's later one: its earlier one is pending
    due_now()
    sender.deliver_due(post=receiver)
    sent = [json.loads(body).get("n") or json.loads(body)["data"]["id"] for _url, body, _h in receiver.calls]
    assert sent == [job.pk, other.pk, job.pk, 2]
    later.refresh_from_db()
    assert later.status == "delivered"


def test_a_claimed_delivery_is_not_claimed_again_until_its_lease_ends(make_webhook):
    delivery = one_delivery(make_webhook)

    (claimed,) = services.deliveries_claim(limit=5)

    assert services.deliveries_claim(limit=5) == []
    later = timezone.now() + services.LEASE + timedelta(seconds=1)
    (again,) = services.deliveries_claim(limit=5, now=later)  # its sender died: due again, same delivery
    assert again.delivery_id == delivery.delivery_id
    # the first sender's late result is not recorded over the second's lease
    services.deliveries_record([(claimed, timezone.now(), Answer(status_code=200))])
    delivery.refresh_from_db()
    assert delivery.status == "pending" and delivery.next_attempt_at == again.next_attempt_at


def test_redelivery_sends_an_ended_delivery_again_with_the_same_id(make_webhook):
    delivery = one_delivery(make_webhook)
    receiver = Receiver(Answer(status_code=404), Answer(status_code=200))
    sender.deliver_due(post=receiver)
    assert services.delivery_redeliver(delivery_id=delivery.delivery_id, actor=SYSTEM).status == "pending"

    assert sender.deliver_due(post=receiver)["delivered"] == 1
    assert [h["X-SimpleTuner-Delivery"] for _u, _b, h in receiver.calls] == [delivery.delivery_id] * 2
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == ("delivered", 2)


def test_a_pending_delivery_cannot_be_redelivered(make_webhook):
    delivery = one_delivery(make_webhook)
    with pytest.raises(ServiceError) as caught:
        services.delivery_redeliver(delivery_id=delivery.delivery_id, actor=SYSTEM)
    assert caught.value.status_code == 409


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_senders_at_once_never_claim_the_same_delivery(postgres_url, make_webhook):
    """SKIP LOCKED is PostgreSQL's (SQLite has one writer): ``postgres_url`` skips with the reason, or fails under CI."""
    make_webhook(events=["job.cancelled"])
    for _ in range(20):
        job_cancel(job_id=JobFactory().pk, actor=SYSTEM)
    start, claimed = threading.Barrier(4), []

    def claim():
        try:
            start.wait()
            claimed.append([d.seq for d in services.deliveries_claim(limit=10)])
        finally:
            connection.close()

    threads = [threading.Thread(target=claim) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    every = [seq for got in claimed for seq in got]
    assert len(every) == len(set(every)) == 20, claimed
