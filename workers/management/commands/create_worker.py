"""Create a worker and print its id, its token (shown once) and the command line that starts its agent."""

import shlex

from django.core.management.base import BaseCommand, CommandError

from workers.models import WorkerType
from workers.services import worker_create

from ._workers import command_actor, service_errors

DEFAULT_ORCHESTRATOR_URL = "http://127.0.0.1:8001"
# `local` is reserved for the orchestrator's built-in worker, as in the API.
CREATABLE_TYPES = (WorkerType.PERSISTENT, WorkerType.EPHEMERAL)


def parse_labels(raw_labels):
    """Return ``{key: value}`` from ``KEY=VALUE`` strings; raise CommandError on a malformed or repeated one."""
    labels = {}
    for raw in raw_labels or ():
        key, sep, value = raw.partition("=")
        key = key.strip()
        if not sep or not key:
            raise CommandError(f"bad label {raw!r}: expected KEY=VALUE, e.g. --label gpu=a100")
        if key in labels:
            raise CommandError(f"label {key!r} given twice")
        labels[key] = value.strip()
    return labels


def agent_command_line(*, worker, token, orchestrator_url):
    """Return the shell line that starts ``worker``'s agent with ``token`` in its environment."""
    argv = ["simpletuner", "worker", "--orchestrator-url", orchestrator_url, "--name", worker.name]
    if worker.worker_type == WorkerType.PERSISTENT:
        argv.append("--persistent")  # the agent's default is ephemeral: exit after one job
    return f"SIMPLETUNER_WORKER_TOKEN={shlex.quote(token)} {shlex.join(argv)}"


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
        labels = parse_labels(labels)
        with service_errors():
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
