"""Time the periodic sweeps over a large fleet: median/p95 ms, queries issued, rows affected, empty runs.

Usage:  python bench/sweep_cost.py [--workers 10000] [--runs 30] [--history 5] [--verbose] [--after-checkpoint]

"loaded cpu" is this process's CPU time during a loaded run (time.process_time): on SQLite that is the
sweep and the database engine together, and, unlike wall time, it barely moves when other work
shares the machine; on PostgreSQL it leaves out the server's own work.

Builds a realistic fleet in a throwaway database: SQLite in a temporary directory by default, or, when
DATABASE_URL names a PostgreSQL server, a scratch database ``st_bench_<random>`` created on that server
and dropped at the end (the database the URL names is only connected to, never written). The fleet:
N workers (85% persistent, 15% ephemeral), heartbeating within the last 30 s except 1% gone silent
for 5-20 minutes; 40% busy with a running job, 1% with a dispatch unacknowledged for minutes (a push
lost in transit) and 0.5% with one just sent; 1% draining; 5% offline for up to 3 hours (the
ephemeral ones among them past the 1 h cleanup age); ``--history`` finished jobs per worker, each
with its attempt, and a queued backlog; one token per worker.

Each sweep is timed on its own fresh copy of that database per run (a sweep changes what it sweeps),
after warming the tables as a live server would have them: the run that finds work ("loaded"), then
the same sweep again, which finds nothing ("empty": the steady state every interval). The first run
is not timed; it counts the queries. ``dispatch_pending``, which a sweep that requeued jobs schedules
on commit, is a sweep of its own (``queue.dispatch_pending``) and is not timed here.
"""

import argparse
import gc
import math
import os
import platform
import random
import secrets
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SCRATCH_PREFIX = "st_bench_"


# --- the throwaway database ---------------------------------------------------------------------


def _with_database(url, name):
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


def _admin(server_url):
    """An autocommit connection for CREATE/DROP DATABASE: to ``postgres``, else the URL's own database."""
    import psycopg

    try:
        return psycopg.connect(_with_database(server_url, "postgres"), autocommit=True, connect_timeout=10)
    except psycopg.OperationalError:
        return psycopg.connect(server_url, autocommit=True, connect_timeout=10)


class Postgres:
    """A scratch database on the server of ``server_url``, and copies of it made with CREATE DATABASE TEMPLATE."""

    def __init__(self, server_url, *, checkpoint=False):
        self.server_url = server_url
        self.name = f"{SCRATCH_PREFIX}{secrets.token_hex(6)}"
        self.copies = []
        self.checkpoint = checkpoint

    def create(self):
        with _admin(self.server_url) as conn:
            conn.execute(f'CREATE DATABASE "{self.name}"')
        return _with_database(self.server_url, self.name)

    def settle(self, cursor):
        cursor.execute("VACUUM ANALYZE")

    def copy(self, index):
        import psycopg

        name = f"{self.name}_r{index}"
        with _admin(self.server_url) as conn:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.name}"')
            self.copies.append(name)
            if self.checkpoint:  # every page the sweep then writes goes to the WAL whole, once
                try:
                    conn.execute("CHECKPOINT")
                except psycopg.Error as exc:  # needs superuser or the pg_checkpoint role
                    sys.exit(f"--after-checkpoint: CHECKPOINT refused: {exc}")
        return name

    def discard(self, name):
        assert name.startswith(SCRATCH_PREFIX), name
        with _admin(self.server_url) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    def drop(self):
        for name in [*self.copies, self.name]:
            self.discard(name)

    def describe(self, cursor):
        cursor.execute("SHOW server_version")
        return f"PostgreSQL {cursor.fetchone()[0]}"


class SQLite:
    """A database file in a temporary directory, and copies of it made with SQLite's backup API."""

    def __init__(self, data_dir):
        self.data_dir = Path(data_dir)
        self.base = str(self.data_dir / "orchestrator.sqlite3")  # where settings.py puts it

    def settle(self, cursor):
        cursor.execute("ANALYZE")

    def copy(self, index):
        name = str(self.data_dir / f"copy_{index}.sqlite3")
        src, dst = sqlite3.connect(self.base), sqlite3.connect(name)
        try:
            src.backup(dst)
        finally:
            src.close()
            dst.close()
        return name

    def discard(self, name):
        for suffix in ("", "-wal", "-shm"):
            Path(name + suffix).unlink(missing_ok=True)

    def drop(self):
        pass

    def describe(self, cursor):
        return f"SQLite {sqlite3.sqlite_version} (WAL, synchronous=NORMAL)"


def use_database(name):
    """Point Django's default connection at database ``name`` (reconnects on next use)."""
    from django.db import connection

    connection.close()
    connection.settings_dict["NAME"] = name


# --- the fleet ----------------------------------------------------------------------------------


def populate(*, workers, history, now, seed=1):
    """Create the fleet described in the module docstring; return how many rows of each kind."""
    from django.db import transaction

    from job_queue.models import AttemptOutcome, Job, JobAttempt, JobStatus, new_lease_id
    from workers.models import Token, TokenKind, Worker, WorkerStatus, WorkerType, generate_token, hash_token

    rng = random.Random(seed)
    ago = lambda seconds: now - timedelta(seconds=seconds)  # noqa: E731
    fleet, jobs, attempts, offline_since = [], [], [], {}

    def hold(worker, status, dispatched_at, started_at=None):
        job = Job(
            config_name=f"bench-{len(jobs)}",
            config={"model_type": "lora", "model_family": "flux"},
            status=status,
            worker_id=worker.pk,
            worker_name=worker.name,
            lease_id=new_lease_id(),
            attempt_count=1,
            dispatched_at=dispatched_at,
            started_at=started_at,
        )
        jobs.append(job)
        attempts.append(
            JobAttempt(
                job_id=job.pk,
                number=1,
                lease_id=job.lease_id,
                worker_id=worker.pk,
                worker_name=worker.name,
                dispatched_at=dispatched_at,
                started_at=started_at,
            )
        )
        worker.current_job_id = job.pk

    for i in range(workers):
        ephemeral = rng.random() < 0.15
        worker = Worker(
            name=f"bench-{i:06d}",
            worker_type=WorkerType.EPHEMERAL if ephemeral else WorkerType.PERSISTENT,
            status=WorkerStatus.IDLE,
            gpu_count=rng.choice((1, 2, 4, 8)),
            gpu_name="NVIDIA A100-SXM4-80GB",
            gpu_vram_gb=80.0,
            accelerator_type="cuda",
            labels={"gpu_type": "a100", "zone": rng.choice(("eu", "us"))},
            stream_id=secrets.token_hex(8),
            connected_at=ago(rng.uniform(3600, 86400)),
            last_heartbeat=ago(rng.uniform(0, 30)),
        )
        roll = rng.random()
        if roll < 0.01:  # gone silent: the heartbeat sweep's work
            worker.last_heartbeat = ago(rng.uniform(300, 1200))
            kind = rng.random()
            if kind < 0.5:
                worker.status = WorkerStatus.BUSY
                hold(worker, JobStatus.RUNNING, ago(7200), ago(7199))
            elif kind < 0.6:
                worker.status = WorkerStatus.BUSY
                hold(worker, JobStatus.DISPATCHED, ago(1300))
        elif roll < 0.41:  # training
            worker.status = WorkerStatus.BUSY
            hold(worker, JobStatus.RUNNING, ago(rng.uniform(60, 36000)), ago(rng.uniform(1, 59)))
        elif roll < 0.42:  # a push lost in transit: the ack sweep's work
            worker.status = WorkerStatus.BUSY
            hold(worker, JobStatus.DISPATCHED, ago(rng.uniform(120, 600)))
        elif roll < 0.425:  # just dispatched, the ack is on its way
            worker.status = WorkerStatus.BUSY
            hold(worker, JobStatus.DISPATCHED, ago(rng.uniform(0, 1)))
        elif roll < 0.435:
            worker.status = WorkerStatus.DRAINING
            worker.drain_requested_at = ago(600)
        elif roll < 0.485:  # offline; the ephemeral ones past the cleanup age are the cleanup's work
            worker.status = WorkerStatus.OFFLINE
            worker.stream_id = None
            worker.last_heartbeat = ago(rng.uniform(600, 10800))
            offline_since[worker.pk] = worker.last_heartbeat + timedelta(seconds=120)
        fleet.append(worker)

    # Finished jobs (some of them on the workers the cleanup deletes) and a queued backlog.
    for _ in range(history * workers):
        worker = rng.choice(fleet)
        finished = ago(rng.uniform(3600, 30 * 86400))
        job = Job(
            config_name="bench-history",
            status=JobStatus.COMPLETED,
            worker_id=worker.pk,
            worker_name=worker.name,
            lease_id=new_lease_id(),
            attempt_count=1,
            dispatched_at=finished - timedelta(hours=2),
            started_at=finished - timedelta(hours=2),
            finished_at=finished,
            progress={"fraction": 1.0},
        )
        jobs.append(job)
        attempts.append(
            JobAttempt(
                job_id=job.pk,
                number=1,
                lease_id=job.lease_id,
                worker_id=worker.pk,
                worker_name=worker.name,
                dispatched_at=job.dispatched_at,
                started_at=job.started_at,
                finished_at=finished,
                outcome=AttemptOutcome.COMPLETED,
            )
        )
    jobs += [Job(config_name="bench-backlog", gpu_count=16) for _ in range(max(workers // 20, 1))]  # fits no one
    tokens = [
        Token(kind=TokenKind.WORKER, digest=hash_token(t), prefix=t[:10], worker_id=w.pk)
        for w, t in ((w, generate_token(TokenKind.WORKER)) for w in fleet)
    ]

    with transaction.atomic():  # foreign keys are checked at commit, so the order does not matter
        Worker.objects.bulk_create(fleet, batch_size=2000)
        Job.objects.bulk_create(jobs, batch_size=2000)
        JobAttempt.objects.bulk_create(attempts, batch_size=2000)
        Token.objects.bulk_create(tokens, batch_size=2000)
        # status_changed_at is auto_now_add: set the offline workers' own afterwards.
        offline = Worker.objects.in_bulk(list(offline_since))
        for pk, since in offline_since.items():
            offline[pk].status_changed_at = since
        Worker.objects.bulk_update(list(offline.values()), ["status_changed_at"], batch_size=500)
    return {"workers": len(fleet), "jobs": len(jobs), "attempts": len(attempts), "tokens": len(tokens)}


def build_fleet(db, *, workers, history, now):
    """Populate the fleet, refresh the planner's statistics, and print what was built on which database."""
    import django
    from django.db import connection

    started = time.monotonic()
    counts = populate(workers=workers, history=history, now=now)
    with connection.cursor() as cursor:
        db.settle(cursor)
        database = db.describe(cursor)
    connection.close()
    print(
        f"{database}; Python {platform.python_version()}, Django {django.get_version()}; "
        f"{os.cpu_count()} CPUs; fleet built in {time.monotonic() - started:.1f} s: "
        + ", ".join(f"{n:,} {kind}" for kind, n in counts.items()),
        flush=True,
    )


@contextmanager
def scratch_database(prefix, *, checkpoint=False):
    """Set Django up on a migrated throwaway database and yield its ``SQLite`` or ``Postgres``; drop it after.

    PostgreSQL when DATABASE_URL names a server (a scratch database on it), else SQLite in a temporary directory.
    """
    server_url = os.environ.get("DATABASE_URL", "")
    if server_url and not server_url.startswith(("postgres://", "postgresql://")):
        sys.exit(f"DATABASE_URL must be a PostgreSQL URL (or unset for SQLite), got {server_url.split(':', 1)[0]}:")
    data_dir = tempfile.mkdtemp(prefix=prefix)
    os.environ["SIMPLETUNER_DATA_DIR"] = data_dir
    os.environ["SIMPLETUNER_LOG_LEVEL"] = "WARNING"
    os.environ["DJANGO_SETTINGS_MODULE"] = "simpletuner_site.settings"
    # No connection pool: a pooled connection left open on the fleet database would keep PostgreSQL from
    # copying it (CREATE DATABASE ... TEMPLATE needs it unused); each copy is connected to afresh anyway.
    os.environ["SIMPLETUNER_DB_POOL_SIZE"] = "0"
    db = Postgres(server_url, checkpoint=checkpoint) if server_url else SQLite(data_dir)
    if server_url:
        os.environ["DATABASE_URL"] = db.create()
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        yield db
    finally:
        from django.db import connection

        connection.close()
        db.drop()
        shutil.rmtree(data_dir, ignore_errors=True)


# --- timing -------------------------------------------------------------------------------------


def warm(cursor):
    """Read every table the sweeps touch, as a live server (heartbeats, dispatch, lists) keeps them cached."""
    for table in ("workers_worker", "workers_token", "queue_job", "queue_jobattempt", "audit_auditevent"):
        cursor.execute(f"SELECT count(*) FROM {table}")
        cursor.fetchone()


def percentile(values, fraction):
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(math.ceil(fraction * len(ordered)) - 1, 0)]


def measure(db, sweep, *, now, runs, verbose=False):
    """Run ``sweep(now=now)`` on ``runs + 1`` fresh copies; return timings, query counts and results.

    With ``verbose``, print the first (untimed) loaded run's statements and how long each took.
    """
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    loaded, loaded_cpu, empty, queries, results = [], [], [], {}, None
    for index in range(runs + 1):
        name = db.copy(index)
        os.sync()  # the copy is on disk before anything is timed
        try:
            use_database(name)
            with connection.cursor() as cursor:
                warm(cursor)
            sweep(now=now - timedelta(days=1))  # nothing is due a day earlier: warms the sweep's own path
            if index == 0:
                with CaptureQueriesContext(connection) as first:
                    results = sweep(now=now)
                with CaptureQueriesContext(connection) as second:
                    again = sweep(now=now)
                queries = {"loaded": len(first), "empty": len(second), "empty_result": again}
                if verbose:
                    for query in first.captured_queries:
                        print(f"    {float(query['time']) * 1000:6.1f} ms  {query['sql'][:120]}")
                continue
            gc.collect()  # this script's own garbage (the fleet, the copies) is not the sweep's cost
            started, started_cpu = time.perf_counter(), time.process_time()
            sweep(now=now)
            loaded.append((time.perf_counter() - started) * 1000)
            loaded_cpu.append((time.process_time() - started_cpu) * 1000)
            gc.collect()
            started = time.perf_counter()
            sweep(now=now)
            empty.append((time.perf_counter() - started) * 1000)
        finally:
            connection.close()
            db.discard(name)
    return {"loaded": loaded, "loaded_cpu": loaded_cpu, "empty": empty, "queries": queries, "result": results}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=30, help="timed runs per sweep (each on a fresh copy)")
    parser.add_argument("--history", type=int, default=5, help="finished jobs per worker")
    parser.add_argument("--verbose", action="store_true", help="print each sweep's statements and their time")
    parser.add_argument(
        "--after-checkpoint",
        action="store_true",
        help="PostgreSQL: CHECKPOINT before each timed run, so that every page a sweep writes is its first write "
        "since a checkpoint (a full-page image in the WAL): the worst case, rarer on a live server whose "
        "heartbeats have already written those pages",
    )
    args = parser.parse_args()

    with scratch_database("st-sweep-bench-", checkpoint=args.after_checkpoint) as db:
        from django.utils import timezone

        import job_queue.services
        import job_queue.sweeps
        from job_queue.sweeps import sweep_unacknowledged_dispatches
        from workers.sweeps import sweep_offline_ephemeral_workers

        try:
            from job_queue.sweeps import sweep_stale_workers
        except ImportError:  # a checkout from before the architecture move (fa36367), for before/after runs
            from workers.sweeps import sweep_stale_workers

        # What a sweep schedules on commit is another sweep's work (see the module docstring).
        job_queue.services.dispatch_pending = job_queue.sweeps.dispatch_pending = lambda **kwargs: 0

        now = timezone.now()
        build_fleet(db, workers=args.workers, history=args.history, now=now)
        print(f"\n{'sweep':<34} {'loaded median':>13} {'p95':>7} {'queries':>7}   {'empty median':>12} {'p95':>7} {'queries':>7} {'loaded cpu':>10}   rows affected")
        for name, sweep in (
            ("queue.sweep_stale_workers", sweep_stale_workers),
            ("queue.sweep_unacknowledged_dispatches", sweep_unacknowledged_dispatches),
            ("workers.sweep_offline_ephemeral_workers", sweep_offline_ephemeral_workers),
        ):
            m = measure(db, sweep, now=now, runs=args.runs, verbose=args.verbose)
            rows = " ".join(f"{k}={v}" for k, v in m["result"].items())
            print(
                f"{name:<34} {statistics.median(m['loaded']):>10.1f} ms {percentile(m['loaded'], 0.95):>7.1f} "
                f"{m['queries']['loaded']:>7}   {statistics.median(m['empty']):>9.1f} ms {percentile(m['empty'], 0.95):>7.1f} "
                f"{m['queries']['empty']:>7} {statistics.median(m['loaded_cpu']):>7.1f} ms   {rows}",
                flush=True,
            )
            assert not any(m["queries"]["empty_result"].values()), m["queries"]["empty_result"]
        print(
            f"\n{args.runs} timed runs per sweep, each on a fresh copy of the fleet"
            + (", right after a CHECKPOINT" if args.after_checkpoint and isinstance(db, Postgres) else "")
            + "; ms = wall time of the call, commit included."
        )


if __name__ == "__main__":
    main()
