"""Create a worker and print its id, its token (shown once) and the command line that starts its agent."""

from django.core.management.base import BaseCommand, CommandError

from workers.models import WorkerType
from workers.onboarding import CREATABLE_TYPES, agent_command_line, parse_label_pairs
from workers.services import worker_create

from ._workers import command_actor, service_errors

DEFAULT_ORCHESTRATOR_URL = "http://127.0.0.1:8001"


class Command(BaseCommand):
    help = (
        "Create a worker; print its id, its token (shown once: rotate_worker_token issues a new one) "
        "and the command line that starts its agent on the GPU machine."
    )

    def add_arguments(self, parser):
        parser.add_argument("name", help="unique worker name; the agent registers with it (--name)")
        parser.add_argument(
            "--type",
            dest="worker_type",
            default=WorkerType.PERSISTENT,
            metavar="|".join(CREATABLE_TYPES),
            help="persistent: stays online between jobs (default); ephemeral: runs one job and is removed",
        )
        parser.add_argument(
            "--label",
            dest="labels",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a label jobs can select on; repeat for several",
        )
        parser.add_argument(
            "--orchestrator-url",
            default=DEFAULT_ORCHESTRATOR_URL,
            metavar="URL",
            help="the URL the agent reaches this orchestrator at, for the printed command "
            f"(default {DEFAULT_ORCHESTRATOR_URL})",
        )

    def handle(self, *, name, worker_type, labels, orchestrator_url, **options):
        if worker_type not in CREATABLE_TYPES:
            raise CommandError(f"unknown worker type {worker_type!r}: expected {' or '.join(CREATABLE_TYPES)}")
        with service_errors():
            labels = parse_label_pairs(labels, example="--label gpu=a100")
            worker, token = worker_create(
                name=name, worker_type=worker_type, labels=labels, actor=command_actor("create_worker")
            )
        shown_labels = ", ".join(f"{key}={value}" for key, value in worker.labels.items()) or "none"
        self.stdout.write(f"Created {worker.worker_type} worker {worker.name!r}, labels: {shown_labels}")
        self.stdout.write(f"Worker id: {worker.pk}")
        self.stdout.write(f"Token (shown once; `manage.py rotate_worker_token {worker.pk}` issues a new one): {token}")
        self.stdout.write("Start its agent on the GPU machine with:")
        self.stdout.write(
            "  " + agent_command_line(worker=worker, token=token, orchestrator_url=orchestrator_url)
        )
