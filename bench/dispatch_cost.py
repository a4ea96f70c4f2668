"""Time the dispatch hot path in one process, without HTTP: statements, commits and milliseconds.

Usage:  python bench/dispatch_cost.py [--workers 200] [--runs 300] [--verbose]

Two operations, each run through the real services with its commit callbacks (the push to the
worker's stream: the local listeners, or Redis when REDIS_URL is set):

- **submit**: ``job_submit`` of a job that one of ``--workers`` idle, stream-connected workers takes at
  once (the operator's submit without the HTTP request around it);
- **completion**: ``job_report`` of ``completed`` from a worker whose job ran, with a backlog of queued
  jobs, so the report also hands the worker its next job;
- **api submit** and **api completion**: the same two through Django's test client, so with the
  middleware, DRF and the token's authentication, but no socket and no ASGI server.

Each worker's event channel already holds an event (the steady state of a live fleet). The first run
of each is not timed; it counts the statements (BEGIN and COMMIT included where the backend sends them)
and the commits. Builds a throwaway database like ``sweep_cost.py``: SQLite in a temporary directory by
default, or a scratch database on DATABASE_URL's PostgreSQL server. Run the same file from another
checkout (copy it into that checkout's bench/) for a before/after.
"""

import argparse
import gc
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sweep_cost import percentile, scratch_database  # noqa: E402


def counted(operation, verbose=False):
    """Run ``operation()`` once; return ``(statements, commits)`` it caused."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with mock.patch.object(connection, "commit", wraps=connection.commit) as commits, CaptureQueriesContext(connection) as captured:
        operation()
    if verbose:
        for query in captured.captured_queries:
            print(f"    {float(query['time']) * 1000:6.2f} ms  {query['sql'][:150]}")
    return len(captured), commits.call_count


def timed(operation, runs, prepare=None, profile=None):
    """Return the milliseconds of ``runs`` calls of ``operation`` (``prepare()`` before each, not timed); with
    ``profile`` (a ``cProfile.Profile``), profile the calls of ``operation`` only (their timings then include the
    profiler's overhead)."""
    timings = []
    for _ in range(runs):
        if prepare is not None:
            prepare()
        gc.collect()
        if profile is not None:
            profile.enable()
        started = time.perf_counter()
        operation()
        timings.append((time.perf_counter() - started) * 1000)
        if profile is not None:
            profile.disable()
    return timings


def profiled(name, operation, runs, prepare=None, top=25):
    """Profile ``runs`` calls of ``operation`` and print its ``top`` functions by their own time and by cumulative
    time, per call of the operation (``--profile``: for comparing two checkouts' hot paths)."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    timed(operation, runs, prepare, profile)
    for order in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profile, stream=out).sort_stats(order).print_stats(top)
        print(f"--- {name}: top {top} by {order} ({runs} calls) ---")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip()))


def report(name, timings, statements, commits):
    print(
        f"{name:14s} median {statistics.median(timings):6.2f} ms   p90 {percentile(timings, 0.9):6.2f} ms   "
        f"{statements} statements, {commits} commit(s)",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=200, help="idle stream-connected workers")
    parser.add_argument("--runs", type=int, default=300, help="timed runs of each operation")
    parser.add_argument("--verbose", action="store_true", help="print each operation's statements")
    parser.add_argument("--profile", action="store_true", help="then profile each operation (cProfile) and print its top functions")
    args = parser.parse_args()

    with scratch_database("st_dispatch_") as db:
        import django
        from django.contrib.auth import get_user_model

        from django.test import Client

        from audit.services import Actor
        from job_queue.models import Job, JobStatus
        from job_queue.reports import job_report
        from job_queue.services import job_submit
        from workers import events as worker_events
        from worker_agent import protocol
        from workers.models import TokenKind, Worker, WorkerStatus
        from workers.services import api_token_create, token_issue

        user = get_user_model().objects.create_superuser(username="bench-operator")
        operator = Actor.for_user(user, "127.0.0.1")
        # SERVER_NAME: a name ALLOWED_HOSTS admits outside production mode (the test client's testserver is not one)
        client = Client(SERVER_NAME="localhost", HTTP_AUTHORIZATION=f"Bearer {api_token_create(user=user, actor=operator)}")
        fleet = Worker.objects.bulk_create(
            [Worker(name=f"bench-{i}", status=WorkerStatus.IDLE, stream_id=f"s{i}") for i in range(args.workers + (4 if args.profile else 2) * (args.runs + 11))]
        )
        for worker in fleet:
            worker_events.publish_on_commit(worker.pk, protocol.PING)  # outside a transaction: stored and pushed now
        print(
            f"{db.__class__.__name__}{' + Redis' if os.environ.get('REDIS_URL') else ''}; Python "
            f"{platform.python_version()}, Django {django.get_version()}; {os.cpu_count()} CPUs; "
            f"{args.workers:,} idle workers left after the last submit",
            flush=True,
        )

        def submit():
            job, dispatched = job_submit(config_name="bench", config={"steps": 1}, actor=operator)
            assert dispatched, "no idle worker took the job"

        def api_submit():
            response = client.post("/api/queue/submit", {"config_name": "bench", "config": {"steps": 1}},
                                   content_type="application/json")
            assert response.status_code == 201 and response.json()["dispatched"], response.content

        for _ in range(10):
            submit()
            api_submit()
        statements, commits = counted(submit, args.verbose)
        report("submit", timed(submit, args.runs), statements, commits)
        statements, commits = counted(api_submit, args.verbose)
        report("api submit", timed(api_submit, args.runs), statements, commits)
        if args.profile:
            profiled("submit", submit, args.runs)
            profiled("api submit", api_submit, args.runs)

        # The completion: one worker, a backlog; each run completes its job, which dispatches the next.
        Worker.objects.filter(status=WorkerStatus.IDLE).update(stream_id=None)  # the fleet leaves: the backlog below queues
        for _ in range((4 if args.profile else 2) * args.runs + 24):
            job_submit(config_name="backlog", actor=operator)
        worker = Worker.objects.create(name="bench-completing", status=WorkerStatus.IDLE, stream_id="s")
        worker_events.publish_on_commit(worker.pk, protocol.PING)
        from job_queue.dispatch import dispatch_for_worker

        dispatch_for_worker(worker.pk)
        state = {}

        def running():
            job = Job.objects.get(worker_id=worker.pk, status=JobStatus.DISPATCHED)
            job_report(worker_id=worker.pk, job_id=job.pk, data={"status": protocol.RUNNING, "attempt": job.lease_id},
                       actor=Actor.for_worker(worker))
            state["job"] = job

        def complete():
            job = state["job"]
            job_report(worker_id=worker.pk, job_id=job.pk, data={"status": protocol.COMPLETED, "attempt": job.lease_id},
                       actor=Actor.for_worker(worker))

        def measure_completion(name, operation):
            for _ in range(5):
                running()
                operation()
            running()
            statements, commits = counted(operation, args.verbose)
            assert Job.objects.filter(worker_id=worker.pk, status=JobStatus.DISPATCHED).exists(), "no next job dispatched"
            report(name, timed(operation, args.runs, prepare=running), statements, commits)
            if args.profile:
                profiled(name, operation, args.runs, prepare=running)

        measure_completion("completion", complete)
        worker_client = Client(SERVER_NAME="localhost", headers={protocol.WORKER_TOKEN_HEADER: token_issue(kind=TokenKind.WORKER, worker=worker)[1]})

        def api_complete():
            job = state["job"]
            response = worker_client.post(protocol.job_status_path(job.pk),
                                          {"status": protocol.COMPLETED, "attempt": job.lease_id}, content_type="application/json")
            assert response.status_code == 200, response.content

        measure_completion("api completion", api_complete)


if __name__ == "__main__":
    main()
