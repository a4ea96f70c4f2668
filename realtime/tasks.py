"""Celery task: the trim of stored worker events (the embedded scheduler runs the same function)."""

from celery import shared_task

from . import sweeps


@shared_task(name="realtime.trim_stored_events", ignore_result=True)
def trim_stored_events():
    return sweeps.trim_stored_events()
