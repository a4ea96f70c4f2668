"""Delete an offline (or never connected) worker; its jobs and audit trail are kept."""

from django.core.management.base import BaseCommand

from workers.services import worker_delete

from ._workers import command_actor, describe, service_errors, worker_lookup


class Command(BaseCommand):
    help = (
        "Delete WORKER (a worker id or name) and its tokens. Only an offline or never-connected worker "
        "can be deleted: drain it and stop its agent first. Its jobs and audit trail are kept."
    )

    def add_arguments(self, parser):
        parser.add_argument("worker", metavar="WORKER", help="worker id or name")

    def handle(self, *, worker, **options):
        found = worker_lookup(worker)
        with service_errors():
            worker_delete(worker_id=found.pk, actor=command_actor("delete_worker"))
        self.stdout.write(f"Deleted worker {describe(found)}.")
