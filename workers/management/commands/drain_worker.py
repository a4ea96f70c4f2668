"""Drain a worker: it finishes its current job and is given no new one."""

from django.core.management.base import BaseCommand

from workers.models import WorkerStatus
from workers.services import worker_drain

from ._workers import command_actor, describe, service_errors, worker_lookup


class Command(BaseCommand):
    help = (
        "Drain WORKER (a worker id or name): it finishes its current job and takes no new one. "
        "The drain survives heartbeats, reconnects and restarts. Running it again changes nothing."
    )

    def add_arguments(self, parser):
        parser.add_argument("worker", metavar="WORKER", help="worker id or name")

    def handle(self, *, worker, **options):
        found = worker_lookup(worker)
        with service_errors():
            drained = worker_drain(worker_id=found.pk, actor=command_actor("drain_worker"))
        if drained.status == WorkerStatus.OFFLINE:
            state = "offline; it comes back draining"
        elif drained.current_job_id:
            state = f"draining; it finishes job {drained.current_job_id} and takes no new one"
        else:
            state = "draining; it takes no new job"
        self.stdout.write(f"Worker {describe(drained)} is {state}.")
