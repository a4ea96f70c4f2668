"""Webhooks: where operators want to hear of jobs and workers, each delivery of an event to one, and its attempts."""

import secrets

from django.conf import settings
from django.db import models
from django.db.models import Q

# What a webhook may subscribe to: a job's end or requeue, a worker going offline.
JOB_COMPLETED = "job.completed"
JOB_FAILED = "job.failed"
JOB_CANCELLED = "job.cancelled"
JOB_REQUEUED = "job.requeued"
WORKER_OFFLINE = "worker.offline"
EVENTS = (JOB_COMPLETED, JOB_FAILED, JOB_CANCELLED, JOB_REQUEUED, WORKER_OFFLINE)

URL_MAX_CHARS = 2000
SECRET_MIN_CHARS = 16
SECRET_MAX_CHARS = 256


def new_webhook_id():
    return "wh_" + secrets.token_hex(8)


def new_delivery_id():
    return "whd_" + secrets.token_hex(8)


class WebhookFormat(models.TextChoices):
    JSON = "json", "JSON"
    SLACK = "slack", "Slack"


class Webhook(models.Model):
    """A receiver of events. Its ``secret`` signs every body and is never shown again after it is set."""

    id = models.CharField(primary_key=True, max_length=32, default=new_webhook_id, editable=False)
    url = models.CharField(max_length=URL_MAX_CHARS, help_text="Where deliveries are POSTed (http or https).")
    events = models.JSONField(default=list, help_text="The events it receives.")
    secret = models.CharField(max_length=SECRET_MAX_CHARS, help_text="Signs each body (HMAC-SHA256); write-only.")
    format = models.CharField(max_length=8, choices=WebhookFormat.choices, default=WebhookFormat.JSON)
    active = models.BooleanField(default=True, help_text="An inactive webhook gets no new deliveries.")
    created_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["created_at"]
        permissions = [("redeliver_webhook", "Can redeliver a webhook's delivery")]

    def __str__(self):
        return f"{self.id} → {self.url}"


class DeliveryStatus(models.TextChoices):
    PENDING = "pending", "Pending"  # waiting for its first attempt or a retry (or being attempted now)
    DELIVERED = "delivered", "Delivered"  # a 2xx answer
    FAILED = "failed", "Failed"  # a refusal not retried (4xx), or retries given up after the retry window


class Delivery(models.Model):
    """One event for one webhook. ``body`` is the exact bytes every attempt sends (and signs); ``seq`` orders the
    deliveries of one subject (a job, a worker): one is sent only when no earlier one of its subject is pending."""

    seq = models.BigAutoField(primary_key=True)
    delivery_id = models.CharField(max_length=40, unique=True, default=new_delivery_id, editable=False)
    webhook = models.ForeignKey(Webhook, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=32)
    subject = models.CharField(max_length=64, help_text="The job or worker it is about: job:<id> or worker:<id>.")
    occurred_at = models.DateTimeField()
    body = models.TextField()
    status = models.CharField(max_length=12, choices=DeliveryStatus.choices, default=DeliveryStatus.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True, help_text="When it is due (or its attempt's lease ends).")
    retry_until = models.DateTimeField(help_text="A retryable failure after this ends it failed.")
    last_status_code = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True, default="")
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-seq"]
        verbose_name_plural = "deliveries"
        indexes = [
            # The senders' read: pending deliveries by when they are due.
            models.Index(fields=["next_attempt_at"], name="webhook_delivery_due", condition=Q(status="pending")),
            # "Is an earlier delivery of this subject to this webhook still pending?"
            models.Index(fields=["webhook", "subject", "seq"], name="webhook_delivery_order", condition=Q(status="pending")),
            models.Index(fields=["webhook", "-seq"], name="webhook_delivery_list"),
            # The trim's read: ended deliveries by when they ended.
            models.Index(fields=["finished_at"], name="webhook_delivery_ended", condition=~Q(status="pending")),
        ]

    def __str__(self):
        return self.delivery_id


class DeliveryAttempt(models.Model):
    """One POST of a delivery: its answer's status code, or the error that stood for one."""

    delivery = models.ForeignKey(Delivery, on_delete=models.CASCADE, related_name="attempt_rows")
    number = models.PositiveIntegerField()
    started_at = models.DateTimeField()
    duration_ms = models.PositiveIntegerField(default=0)
    status_code = models.PositiveIntegerField(null=True, blank=True)
    error = models.CharField(max_length=500, blank=True, default="")
    outcome = models.CharField(max_length=12, help_text="delivered, retry or failed")

    class Meta:
        ordering = ["delivery", "number"]
        indexes = [models.Index(fields=["delivery", "number"], name="webhook_attempt_of")]

    def __str__(self):
        return f"{self.delivery.delivery_id} #{self.number}"
