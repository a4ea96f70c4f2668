"""Celery tasks: the webhook sender's pass and the trim of old deliveries (the embedded scheduler runs the same
functions without a broker)."""

from celery import shared_task

from . import sender, sweeps


@shared_task(name="webhooks.deliver_due", ignore_result=True)
def deliver_due():
    return sender.deliver_due()


@shared_task(name="webhooks.trim_deliveries", ignore_result=True)
def trim_deliveries():
    return sweeps.trim_deliveries()
