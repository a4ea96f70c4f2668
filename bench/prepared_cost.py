"""Time the hot path's prepared reads against the same reads built and compiled by the ORM on each call.

Usage:  python bench/prepared_cost.py [--runs 3000]

Two reads every request repeats: a worker token's authentication (the token, its worker and user, and
whether it is due to be marked used) and ``lock_job`` (a job row locked for update, in a transaction).
Each is timed as the ORM would run it (``QuerySet`` built, compiled and hydrated per call) and as
``common.prepared.PreparedQuery`` runs it (compiled once). Builds a throwaway database like
``sweep_cost.py``: SQLite by default, or a scratch database on DATABASE_URL's PostgreSQL server.
"""

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep_cost import scratch_database  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3000, help="timed calls of each read")
    args = parser.parse_args()

    with scratch_database("st_prepared_") as db:
        import django
        from django.db import transaction
        from django.db.models import BooleanField, ExpressionWrapper
        from django.utils import timezone

        from job_queue.models import Job
        from job_queue.services import lock_job
        from workers import services
        from workers.models import TokenKind, Worker, WorkerStatus

        worker = Worker.objects.create(name="bench", status=WorkerStatus.IDLE)
        _, secret = services.token_issue(kind=TokenKind.WORKER, worker=worker)
        digest = services.hash_token(secret)
        job = Job.objects.create(config_name="bench")

        def orm_authentication():
            now = timezone.now()
            due = ExpressionWrapper(services._touch_due(services._touched_before(now)), output_field=BooleanField())
            tokens = services._active_tokens(kind=TokenKind.WORKER, digest=digest, now=now)
            return next(iter(tokens.select_related("worker").annotate(touch_due=due)[:1]))

        def prepared_authentication():
            now = timezone.now()
            return services._AUTHENTICATE.first(
                TokenKind.WORKER, digest=digest, now=now, touched_before=services._touched_before(now)
            )

        def orm_lock_job():
            with transaction.atomic():
                return Job.objects.select_for_update().filter(pk=job.pk).first()

        def prepared_lock_job():
            with transaction.atomic():
                return lock_job(job.pk)

        print(
            f"{db.__class__.__name__}; Python {platform.python_version()}, Django {django.get_version()}; "
            f"{os.cpu_count()} CPUs; {args.runs} timed calls each, after 200 untimed",
            flush=True,
        )
        reads = [
            ("token authentication, ORM", orm_authentication),
            ("token authentication, prepared", prepared_authentication),
            ("lock_job in a transaction, ORM", orm_lock_job),
            ("lock_job in a transaction, prepared", prepared_lock_job),
        ]
        assert orm_authentication().worker == prepared_authentication().worker == worker
        for name, read in reads:
            for _ in range(200):
                read()
            timings = []
            for _ in range(args.runs):
                started = time.perf_counter()
                read()
                timings.append((time.perf_counter() - started) * 1e6)
            print(f"{name:38s} median {statistics.median(timings):7.1f} µs", flush=True)


if __name__ == "__main__":
    main()
