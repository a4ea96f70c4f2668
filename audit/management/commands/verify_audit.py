"""Check the audit log's hash chain: exit 0 when intact, 1 at a broken or missing link, 2 on bad arguments.

It checks the sealed rows and says how many are not sealed yet (``audit.sweeps``) and how old the oldest is.
"""

import sys
import time
from datetime import datetime, timezone as dt_timezone

from django.core.management.base import BaseCommand, CommandError
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from audit.selectors import audit_chain_verify


def _moment(value):
    """Return the aware datetime an ISO 8601 date or date-time names (a naive one is UTC)."""
    moment = parse_datetime(value)
    if moment is None and (day := parse_date(value)) is not None:
        moment = datetime(day.year, day.month, day.day)
    if moment is None:
        raise CommandError(f"not an ISO 8601 date or date-time: {value!r}", returncode=2)
    return moment if timezone.is_aware(moment) else moment.replace(tzinfo=dt_timezone.utc)


def _unsealed(report):
    """Return the line saying how many rows are not sealed yet, and the age of the oldest."""
    if not report.unsealed:
        return "Not sealed yet: no rows."
    age = (timezone.now() - report.oldest_unsealed).total_seconds()
    return f"Not sealed yet: {report.unsealed} row(s), the oldest written {age:.1f} s ago."


class Command(BaseCommand):
    help = (
        "Recompute the audit log's HMAC chain (SIMPLETUNER_AUDIT_KEY) over the sealed rows in seq order and report "
        "the first broken link (an edited row) or missing link (a deleted row), and how many rows are not sealed "
        "yet. Exit 0 when intact, 1 otherwise."
    )

    def add_arguments(self, parser):
        parser.add_argument("--since", help="ISO 8601: start at the first row written at or after this time")
        parser.add_argument("--until", help="ISO 8601: stop before the first row written at or after this time")

    def handle(self, *args, since=None, until=None, **options):
        since = _moment(since) if since else None
        until = _moment(until) if until else None
        started = time.monotonic()
        report = audit_chain_verify(since=since, until=until)
        elapsed = time.monotonic() - started
        self.stdout.write(_unsealed(report))
        if report.first_seq is None:
            self.stdout.write("No sealed audit rows in that range.")
            return
        span = f"seq {report.first_seq}-{report.last_seq}"
        if report.intact:
            self.stdout.write(f"Audit chain intact: {report.checked} links checked ({span}) in {elapsed:.1f} s.")
            return
        first = report.faults[0]
        where = f"seq {first.seq}" + (f" (id {first.row_id}, {first.created_at.isoformat()})" if first.row_id else "")
        self.stderr.write(f"First {first.kind} link at {where}: {first.detail}.")
        for fault in report.faults[1:]:
            self.stderr.write(f"  then {fault.kind} at seq {fault.seq}: {fault.detail}")
        self.stderr.write(
            f"Audit chain NOT intact: {report.fault_count} fault(s); {report.checked} links checked ({span}) in {elapsed:.1f} s."
        )
        sys.exit(1)
