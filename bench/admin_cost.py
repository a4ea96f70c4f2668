"""Time the admin's pages over a large fleet: median/p95 ms and queries per page, as an operator opens them.

Usage:  python bench/admin_cost.py [--workers 10000] [--history 10] [--audit 1000000] [--runs 20] [--verbose]

Builds the fleet of ``bench/sweep_cost.py`` (~105,000 jobs at the defaults) plus ``--audit`` audit rows
in a throwaway database: SQLite in a temporary directory, or a scratch PostgreSQL database when
DATABASE_URL names a PostgreSQL server (created and dropped by the script). Each run is one GET through
Django's whole request path as a signed-in superuser: the index with its fleet overview, the workers
and jobs lists (100 rows a page), a label filter, the live-rows refresh of a full page, a job's page,
and the audit log unfiltered, filtered and searched.
"""

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep_cost import build_fleet, percentile, scratch_database, warm  # noqa: E402

AUDIT_BATCH = 5000


def add_audit_trail(rows, *, worker_ids, job_ids, now):
    """Insert ``rows`` audit events spread over 90 days, about workers and jobs of the fleet."""
    from datetime import timedelta

    from audit import actions
    from audit.models import AuditEvent
    from audit.services import audit_write

    rng = random.Random(7)
    kinds = [
        ("worker", actions.WORKER_STATUS_CHANGED, worker_ids),
        ("job", actions.JOB_STATUS_CHANGED, job_ids),
        ("job", actions.JOB_DISPATCHED, job_ids),
        ("worker", actions.WORKER_REGISTERED, worker_ids),
    ]
    # Spread over 90 days, as a real trail is, and chained as the services write it.
    for start in range(0, rows, AUDIT_BATCH):
        batch = []
        for _ in range(min(AUDIT_BATCH, rows - start)):
            target_type, action, ids = rng.choice(kinds)
            batch.append(
                AuditEvent(
                    created_at=now - timedelta(seconds=rng.randrange(90 * 86400)),
                    actor_type="system", actor_name="bench", action=action, target_type=target_type,
                    target_id=rng.choice(ids), details={"from": "idle", "to": "busy"},
                )
            )  # fmt: skip
        audit_write(batch)


def measure(client, path, *, runs, verbose=False):
    """Return ``(timings_ms, queries)`` for ``runs`` timed GETs of ``path`` after 2 warm-up runs.

    With ``verbose``, print the statements of one untimed GET and how long each took.
    """
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    for _ in range(2):
        response = client.get(path)
        assert response.status_code == 200, f"{path}: HTTP {response.status_code}"
    with CaptureQueriesContext(connection) as captured:
        client.get(path)
    queries = len(captured)
    if verbose:
        for query in captured.captured_queries:
            print(f"    {float(query['time']) * 1000:6.1f} ms  {query['sql'][:120]}")
    timings = []
    for _ in range(runs):
        gc.collect()
        started = time.perf_counter()
        client.get(path)
        timings.append((time.perf_counter() - started) * 1000)
    return timings, queries


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=10_000)
    parser.add_argument("--history", type=int, default=10, help="finished jobs per worker")
    parser.add_argument("--audit", type=int, default=1_000_000, help="audit rows")
    parser.add_argument("--runs", type=int, default=20, help="timed requests per page")
    parser.add_argument("--verbose", action="store_true", help="print each page's statements and their time")
    args = parser.parse_args()

    with scratch_database("st-admin-bench-") as db:
        from django.contrib.admin.utils import quote
        from django.contrib.auth import get_user_model
        from django.db import connection
        from django.test import Client
        from django.utils import timezone

        from audit.models import AuditEvent
        from job_queue.models import Job
        from workers.models import Worker

        now = timezone.now()
        build_fleet(db, workers=args.workers, history=args.history, now=now)
        worker_ids = list(Worker.objects.values_list("pk", flat=True))
        job_ids = list(Job.objects.values_list("pk", flat=True))
        started = time.monotonic()
        add_audit_trail(args.audit, worker_ids=worker_ids, job_ids=job_ids, now=now)
        with connection.cursor() as cursor:
            db.settle(cursor)
            warm(cursor)
        print(f"{AuditEvent.objects.count():,} audit rows added in {time.monotonic() - started:.1f} s", flush=True)

        admin = get_user_model().objects.create_superuser("bench-admin", "", None)
        client = Client(SERVER_NAME="localhost")  # a name ALLOWED_HOSTS admits outside production mode (testserver is not)
        client.force_login(admin)
        Worker.objects.filter(pk=worker_ids[0]).update(labels={"gpu": "a100", "zone": "eu"})
        page_workers = ",".join(worker_ids[:100])
        page_jobs = ",".join(job_ids[:100])
        pages = [
            ("index (fleet overview)", "/admin/"),
            ("workers list", "/admin/workers/worker/"),
            ("workers list, label filter", "/admin/workers/worker/?label=gpu%3Da100"),
            ("workers live rows (100)", f"/admin/workers/worker/live/?ids={page_workers}"),
            ("jobs list", "/admin/queue/job/"),
            ("jobs live rows (100)", f"/admin/queue/job/live/?ids={page_jobs}"),
            ("a job's page", f"/admin/queue/job/{quote(job_ids[0])}/change/"),
            ("audit log", "/admin/audit/auditevent/"),
            ("audit log, one action", "/admin/audit/auditevent/?action=job.dispatched"),
            ("audit log, one target", f"/admin/audit/auditevent/?q={worker_ids[0]}"),
        ]
        print(f"\n{'page':32} {'median ms':>10} {'p95 ms':>8} {'queries':>8}")
        for name, path in pages:
            timings, queries = measure(client, path, runs=args.runs, verbose=args.verbose)
            print(f"{name:32} {statistics.median(timings):10.1f} {percentile(timings, 0.95):8.1f} {queries:8d}", flush=True)


if __name__ == "__main__":
    main()
