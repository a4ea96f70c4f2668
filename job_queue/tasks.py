"""Celery tasks: the dispatch safety net behind the event-driven path, and the sweeps that recover jobs."""

from celery import shared_task

from . import dispatch, sweeps


@shared_task(name="queue.dispatch_pending", ignore_result=True)
def dispatch_pending():
    return dispatch.dispatch_pending()


@shared_task(name="queue.sweep_stale_workers", ignore_result=True)
def sweep_stale_workers():
    return sweeps.sweep_stale_workers()


@shared_task(name="queue.sweep_unacknowledged_dispatches", ignore_result=True)
def sweep_unacknowledged_dispatches():
    return sweeps.sweep_unacknowledged_dispatches()


@shared_task(name="queue.sweep_fairshare_charge", ignore_result=True)
def sweep_fairshare_charge():
    return sweeps.sweep_fairshare_charge()
