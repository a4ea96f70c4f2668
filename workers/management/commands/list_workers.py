"""List workers as a table: id, name, type, status, GPUs, labels, current job and last heartbeat."""

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone

from common.humanize import ago, printable
from workers.models import Worker, WorkerStatus

COLUMNS = ("ID", "NAME", "TYPE", "STATUS", "GPUS", "LABELS", "JOB", "HEARTBEAT")


def parse_statuses(raw):
    """Return the statuses named in ``raw`` (comma-separated); raise CommandError on an unknown one."""
    statuses = [part.strip() for part in raw.split(",") if part.strip()]
    unknown = sorted(set(statuses) - set(WorkerStatus.values))
    if unknown or not statuses:
        named = ", ".join(unknown) or repr(raw)
        raise CommandError(f"unknown status {named}: expected one or more of {', '.join(WorkerStatus.values)}")
    return statuses


def gpus(worker):
    """Return ``count × name`` (or ``-`` for a worker that reported no GPU)."""
    if not worker.gpu_count:
        return "-"
    return f"{worker.gpu_count} × {worker.gpu_name or 'unknown GPU'}"


def row(worker, now):
    """Return the table cells of ``worker``."""
    status = worker.status
    if worker.drain_requested_at is not None and status != WorkerStatus.DRAINING:
        status += " (drain requested)"
    labels = ",".join(f"{key}={value}" for key, value in sorted(worker.labels.items())) or "-"
    cells = (
        worker.pk,
        worker.name,
        worker.worker_type,
        status,
        gpus(worker),
        labels,
        worker.current_job_id or "-",
        ago(worker.last_heartbeat, now),
    )
    return tuple(printable(cell) for cell in cells)  # names, labels and GPU names come from workers


def table(rows):
    """Return ``rows`` under COLUMNS as left-aligned lines, columns two spaces apart."""
    widths = [max(len(str(cells[i])) for cells in (COLUMNS, *rows)) for i in range(len(COLUMNS))]
    return [
        "  ".join(str(cell).ljust(width) for cell, width in zip(cells, widths)).rstrip() for cells in (COLUMNS, *rows)
    ]


class Command(BaseCommand):
    help = "List workers: id, name, type, status, GPUs, labels, current job and last heartbeat."

    def add_arguments(self, parser):
        parser.add_argument(
            "--status",
            metavar="STATUS[,STATUS]",
            help=f"only workers in these statuses ({', '.join(WorkerStatus.values)})",
        )

    def handle(self, *, status, **options):
        workers = Worker.objects.order_by("name")
        if status is not None:
            statuses = parse_statuses(status)
            workers = workers.filter(status__in=statuses)
        now = timezone.now()
        rows = [row(worker, now) for worker in workers]
        if not rows:
            self.stdout.write("No workers." if status is None else f"No workers with status {', '.join(statuses)}.")
            return
        for line in table(rows):
            self.stdout.write(line)
