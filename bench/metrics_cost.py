"""Time a Prometheus scrape of /metrics over a large fleet: median/p95 ms of the whole request, queries, size.

Usage:  python bench/metrics_cost.py [--workers 10000] [--history 10] [--runs 200] [--verbose]

Builds the same fleet as ``bench/sweep_cost.py`` (N workers in every status, a running or unacknowledged
job on 41.5% of them, a queued backlog, ``--history`` finished jobs per worker: ~105,000 jobs at the
defaults) in a throwaway database: SQLite in a temporary directory, or a scratch PostgreSQL database
``st_bench_<random>`` when DATABASE_URL names a PostgreSQL server (created and dropped by the script).

Each run is one GET /metrics through Django's whole request path (middleware, URL routing, the DRF view,
Bearer-token authentication of an operator, the database collector's queries, the text encoding) with
the default access mode (``operators``) and a single process (no PROMETHEUS_MULTIPROC_DIR). A scrape only
reads, so every run uses the same database, after a few untimed warm-up runs.
"""

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep_cost import build_fleet, percentile, scratch_database, warm  # noqa: E402


def measure(client, token, *, runs, verbose=False):
    """Return ``(timings_ms, queries, response)`` for ``runs`` timed GET /metrics after 5 warm-up runs."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    headers = {"HTTP_AUTHORIZATION": f"Bearer {token}"}
    for _ in range(5):
        response = client.get("/metrics", **headers)
        assert response.status_code == 200, response.content[:200]
    with CaptureQueriesContext(connection) as captured:
        response = client.get("/metrics", **headers)
    queries = len(captured)  # read now: the next request resets the connection's query log
    if verbose:
        for query in captured.captured_queries:
            print(f"    {float(query['time']) * 1000:6.1f} ms  {query['sql'][:160]}")
    timings = []
    for _ in range(runs):
        gc.collect()
        started = time.perf_counter()
        client.get("/metrics", **headers)
        timings.append((time.perf_counter() - started) * 1000)
    return timings, queries, response


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=10_000)
    parser.add_argument("--history", type=int, default=10, help="finished jobs per worker")
    parser.add_argument("--runs", type=int, default=200, help="timed scrapes")
    parser.add_argument("--verbose", action="store_true", help="print the scrape's statements and their time")
    args = parser.parse_args()

    # The defaults: operators only, each process its own registry.
    os.environ.pop("SIMPLETUNER_METRICS", None)
    os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
    with scratch_database("st-metrics-bench-") as db:
        from django.contrib.auth import get_user_model
        from django.db import connection
        from django.test import Client
        from django.utils import timezone

        from workers.models import TokenKind
        from workers.services import token_issue

        build_fleet(db, workers=args.workers, history=args.history, now=timezone.now())
        operator = get_user_model().objects.create_user("bench-operator")
        token = token_issue(kind=TokenKind.API, user=operator)[1]
        with connection.cursor() as cursor:
            warm(cursor)
        client = Client(SERVER_NAME="localhost")  # a name ALLOWED_HOSTS admits outside production mode (testserver is not)
        timings, queries, response = measure(client, token, runs=args.runs, verbose=args.verbose)
        body = response.content.decode()
        series = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
        print(
            f"\nGET /metrics: median {statistics.median(timings):.1f} ms, p95 {percentile(timings, 0.95):.1f} ms, "
            f"min {min(timings):.1f} ms over {args.runs} runs; {queries} queries (authentication included); "
            f"{len(response.content):,} bytes, {series} samples"
        )
        for line in body.splitlines():
            if line.startswith(("simpletuner_workers{", "simpletuner_jobs{")) and not line.endswith(" 0.0"):
                print(f"    {line}")


if __name__ == "__main__":
    main()
