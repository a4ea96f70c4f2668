"""Celery tasks: the sealer's scheduled run (the embedded scheduler runs the same function without a broker)."""

from celery import shared_task

from . import sweeps


@shared_task(name="audit.seal_chain", ignore_result=True)
def seal_chain():
    return sweeps.seal_chain()
