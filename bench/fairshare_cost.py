"""Time dispatch under fair share and limits with a large backlog: milliseconds (p50, p95) and statements per dispatch.

Usage:  python bench/fairshare_cost.py [--jobs 10000] [--users 100] [--teams 10] [--workers 1000] [--runs 300]
                                       [--limit N] [--verbose]

Sets up ``--jobs`` queued jobs from ``--users`` users in ``--teams`` teams (each team's share with a decayed GPU
usage of its own), and ``--workers`` idle, stream-connected workers, then times, through the real services with
their commit callbacks:

- **freed worker**: ``dispatch_for_worker`` of an idle worker (what a worker whose job ended, or whose stream
  opened, runs): the head of each share, the best of them in fair order, locked and assigned;
- **submit**: ``job_submit`` of a team member's job that an idle worker takes at once, behind the backlog.

``--limit N`` gives every team a ``max_running_jobs`` of N (high enough not to hold back): the dispatches then
read and lock the limits. The first run of each is not timed; it counts the statements. Builds a throwaway
database like ``sweep_cost.py``: SQLite in a temporary directory by default, or a scratch database on
DATABASE_URL's PostgreSQL server.
"""

import argparse
import gc
import os
import platform
import random
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dispatch_cost import counted  # noqa: E402
from sweep_cost import percentile, scratch_database  # noqa: E402


def timed(operations):
    timings = []
    for operation in operations:
        gc.collect()
        started = time.perf_counter()
        operation()
        timings.append((time.perf_counter() - started) * 1000)
    return timings


def report(name, timings, statements):
    print(
        f"{name:13s} p50 {statistics.median(timings):6.2f} ms   p95 {percentile(timings, 0.95):6.2f} ms   "
        f"{statements} statements per dispatch ({len(timings)} runs)",
        flush=True,
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=10_000, help="queued jobs")
    parser.add_argument("--users", type=int, default=100, help="submitting users")
    parser.add_argument("--teams", type=int, default=10, help="teams the users are in")
    parser.add_argument("--workers", type=int, default=1000, help="idle stream-connected workers")
    parser.add_argument("--runs", type=int, default=300, help="timed dispatches of each kind")
    parser.add_argument("--limit", type=int, default=None, help="every team's max_running_jobs (default: no limit)")
    parser.add_argument("--verbose", action="store_true", help="print each operation's statements")
    args = parser.parse_args()
    if 2 * (args.runs + 1) > args.workers:
        sys.exit("--workers must be at least twice --runs + 2: each dispatch takes an idle worker")

    with scratch_database("st_fairshare_") as db:
        import django
        from django.contrib.auth import get_user_model
        from django.db import connection
        from django.utils import timezone

        from audit.services import Actor
        from job_queue import fairshare
        from job_queue.dispatch import dispatch_for_worker
        from job_queue.models import FairShare, Job, JobStatus
        from job_queue.services import job_submit
        from tenancy.models import LimitScope, Limits, Team
        from worker_agent import protocol
        from workers import events as worker_events
        from workers.models import Worker, WorkerStatus

        rng = random.Random(29)
        now = timezone.now()
        User = get_user_model()
        teams = Team.objects.bulk_create([Team(name=f"team-{i}") for i in range(args.teams)])
        users = User.objects.bulk_create([User(username=f"user-{i}") for i in range(args.users)])
        membership = Team.members.through
        membership.objects.bulk_create(
            [membership(team_id=teams[i % args.teams].pk, user_id=user.pk) for i, user in enumerate(users)]
        )
        if args.limit is not None:
            Limits.objects.bulk_create(
                [Limits(scope=LimitScope.TEAM, team=team, max_running_jobs=args.limit) for team in teams]
            )
        jobs = []
        for i in range(args.jobs):
            k = rng.randrange(args.users)
            jobs.append(
                Job(config_name="backlog", status=JobStatus.QUEUED, priority=rng.choice((0, 0, 0, 1)),
                    submitted_by=users[k], team=teams[k % args.teams])
            )
        Job.objects.bulk_create(jobs, batch_size=1000)
        Job.objects.update(submitted_at=now - timedelta(hours=1))
        fairshare.shares_ensure_queued()
        for share in FairShare.objects.all():  # each share some GPU time of its own over the last week
            for _ in range(5):
                share.usage_log = fairshare.usage_add(
                    share.usage_log, rng.uniform(1e3, 1e6), now - timedelta(seconds=rng.uniform(0, 7 * 86400))
                )
            share.save(update_fields=["usage_log"])
        fleet = Worker.objects.bulk_create(
            [Worker(name=f"bench-{i}", status=WorkerStatus.IDLE, stream_id=f"s{i}") for i in range(args.workers)],
            batch_size=1000,
        )
        for worker in fleet:
            worker_events.publish_on_commit(worker.pk, protocol.PING)  # the steady state: each channel has an event
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE")
        print(
            f"{db.__class__.__name__}; Python {platform.python_version()}, Django {django.get_version()}; "
            f"{os.cpu_count()} CPUs; {args.jobs:,} queued jobs, {args.users} users in {args.teams} teams, "
            f"{args.workers:,} idle workers; team limits: {args.limit if args.limit is not None else 'none'}",
            flush=True,
        )

        idle = iter(fleet)
        offers = [lambda worker=next(idle): dispatch_for_worker(worker.pk) for _ in range(args.runs + 1)]
        statements, _ = counted(offers[0], args.verbose)
        report("freed worker", timed(offers[1:]), statements)

        actors = [Actor.for_user(user, "127.0.0.1") for user in users]

        def submit():
            _, dispatched = job_submit(config_name="bench", actor=rng.choice(actors))
            assert dispatched, "no idle worker took the job"

        statements, _ = counted(submit, args.verbose)
        report("submit", timed([submit] * args.runs), statements)

        # A read, not a dispatch: where a queued job stands (the job detail, and a submit that waits, say it).
        queued = Job.objects.filter(status=JobStatus.QUEUED).order_by("?").values_list("pk", flat=True)[: args.runs]
        places = [lambda pk=pk: fairshare.queue_positions([pk]) for pk in queued]
        statements, _ = counted(places[0], args.verbose)
        report("a queued job's queue_position", timed(places), statements)


if __name__ == "__main__":
    main()
