"""Celery tasks: the dispatch safety net behind the event-driven path."""

from celery import shared_task

from . import services


@shared_task(name="queue.dispatch_pending", ignore_result=True)
def dispatch_pending():
    return services.dispatch_pending()
