"""Celery tasks of the artifact store: the retention sweep."""

from celery import shared_task

from . import sweeps


@shared_task(name="artifacts.sweep_expired_artifacts", ignore_result=True)
def sweep_expired_artifacts():
    return sweeps.sweep_expired_artifacts()
