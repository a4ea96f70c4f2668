"""Issue a new token for a worker (printed once on stdout); its old tokens and their streams stop at once."""

from django.core.management.base import BaseCommand

from workers.services import worker_rotate_token

from ._workers import command_actor, describe, service_errors, worker_lookup


class Command(BaseCommand):
    help = (
        "Revoke WORKER's tokens (its open streams are closed) and print a new one, once. "
        "WORKER is a worker id or name."
    )

    def add_arguments(self, parser):
        parser.add_argument("worker", metavar="WORKER", help="worker id or name")

    def handle(self, *, worker, **options):
        found = worker_lookup(worker)
        with service_errors():
            token = worker_rotate_token(worker_id=found.pk, actor=command_actor("rotate_worker_token"))
        self.stderr.write(
            f"New token for worker {describe(found)} (shown once; the old one is refused from now on). "
            "Restart its agent with SIMPLETUNER_WORKER_TOKEN set to:"
        )
        self.stdout.write(token)
