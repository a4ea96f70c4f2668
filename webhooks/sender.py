"""Sending deliveries after the commit: ``deliver_due`` claims what is due, POSTs it signed, records each attempt.

It runs outside any request, from a background worker: Celery in production (the task ``webhooks.deliver_due``,
run by beat every ``SWEEP_INTERVAL`` seconds and kicked after each commit that stages deliveries); on the
embedded default this process's sender thread (``SENDER``), woken on commit and by the in-process scheduler
every ``SWEEP_INTERVAL`` seconds, so no receiver is called on the scheduler's own thread. No database
transaction is open while a receiver is being called.
"""

import hashlib
import hmac
import time
from concurrent.futures import ThreadPoolExecutor

from django.conf import settings
from django.utils import timezone

from common.background import WokenThread

from . import client
from .services import deliveries_claim, deliveries_record

SWEEP_INTERVAL = 5  # seconds between the scheduled passes: a retry is sent within this of falling due
SENDERS = 8  # receivers called at once by one pass
PASS_BUDGET_S = 20.0  # a pass claims no more once it has run this long (the next pass goes on)

EVENT_HEADER = "X-SimpleTuner-Event"
DELIVERY_HEADER = "X-SimpleTuner-Delivery"
SIGNATURE_HEADER = "X-SimpleTuner-Signature"


def signature(secret, body):
    """Return the ``X-SimpleTuner-Signature`` of ``body`` (bytes): ``sha256=`` and the hex HMAC-SHA256 with ``secret``."""
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def request_headers(delivery, body):
    return {
        "Content-Type": "application/json",
        EVENT_HEADER: delivery.event,
        DELIVERY_HEADER: delivery.delivery_id,
        SIGNATURE_HEADER: signature(delivery.webhook.secret, body),
    }


def send(delivery, *, post=client.post):
    """POST one claimed delivery; return ``(delivery, started_at, answer)`` for ``deliveries_record``."""
    body = delivery.body.encode()
    started_at = timezone.now()
    return delivery, started_at, post(delivery.webhook.url, body, request_headers(delivery, body))


def deliver_due(*, post=client.post, budget=PASS_BUDGET_S, clock=time.monotonic):
    """Send the deliveries due now, ``SENDERS`` at a time, until none is due or ``budget`` seconds have passed.

    Return ``{"delivered": n, "retrying": n, "failed": n}``. Safe to run in several processes at once.
    """
    counts = {"delivered": 0, "retrying": 0, "failed": 0}
    started = clock()
    with ThreadPoolExecutor(max_workers=SENDERS, thread_name_prefix="webhook-send") as pool:
        while clock() - started < budget:
            claimed = deliveries_claim(limit=SENDERS)
            if not claimed:
                break
            results = list(pool.map(lambda d: send(d, post=post), claimed))
            for result in deliveries_record(results):
                counts["retrying" if result == "retry" else result] += 1
    return counts


def _pass():
    """The sender thread's pass: with Celery (REDIS_URL) hand it to a Celery worker, else send from this process."""
    if settings.REDIS_URL:
        from .tasks import deliver_due as task

        task.apply_async(expires=SWEEP_INTERVAL * 2)
    else:
        deliver_due()


# This process's sender thread: started by the first ``wake()`` (a commit that staged deliveries, or the embedded
# scheduler's pass), it runs ``_pass`` whenever woken.
SENDER = WokenThread("webhook-sender", _pass, failed="webhook deliveries not sent now; the scheduled pass sends them")

