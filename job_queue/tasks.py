"""Celery tasks: the dispatch safety net behind the event-driven path, and the dispatch-ack sweep."""

from celery import shared_task

from . import services, sweeps


@shared_task(name="queue.dispatch_pending", ignore_result=True)
def dispatch_pending():
    return services.dispatch_pending()


@shared_task(name="queue.sweep_unacknowledged_dispatches", ignore_result=True)
def sweep_unacknowledged_dispatches():
    return sweeps.sweep_unacknowledged_dispatches()
