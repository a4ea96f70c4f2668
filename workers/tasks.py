"""Celery tasks: thin wrappers that run the workers' own sweep under Celery beat."""

from celery import shared_task

from . import sweeps


@shared_task(name="workers.sweep_offline_ephemeral_workers", ignore_result=True)
def sweep_offline_ephemeral_workers():
    return sweeps.sweep_offline_ephemeral_workers()
