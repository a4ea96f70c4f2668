"""Issue a new token for a worker (printed once on stdout); its old tokens and their streams stop at once."""

from django.core.management.base import BaseCommand

from job_queue.fleet import worker_rotate_token
from workers.management.commands._workers import command_actor, describe, service_errors, worker_lookup


class Command(BaseCommand):
    help = (
        "Revoke WORKER's tokens (its open streams are closed) and print a new one, once. "
        "WORKER is a worker id or name. Refused while the worker runs a job, unless --force "
        "(the job then goes back to the queue without spending a retry)."
    )

    def add_arguments(self, parser):
        parser.add_argument("worker", metavar="WORKER", help="worker id or name")
        parser.add_argument("--force", action="store_true", help="rotate even while the worker runs a job")

    def handle(self, *, worker, force, **options):
        found = worker_lookup(worker)
        with service_errors():
            token, job_id = worker_rotate_token(
                worker_id=found.pk, actor=command_actor("rotate_worker_token"), force=force
            )
        if job_id:
            self.stderr.write(f"Job {job_id} was taken back from the worker and requeued (no retry spent).")
        self.stderr.write(
            f"New token for worker {describe(found)} (shown once; the old one is refused from now on). "
            "Restart its agent with SIMPLETUNER_WORKER_TOKEN set to:"
        )
        self.stdout.write(token)
