"""Time ``manage.py verify_audit`` over a million chained audit rows, and the audit's writes and their sealing.

Usage:  python bench/audit_verify.py [--rows 1000000] [--seconds 5] [--writers 1 2 4]

In a throwaway database (SQLite in a temporary directory, or a scratch database ``st_bench_<random>``
on the PostgreSQL server DATABASE_URL names, dropped at the end; see ``bench/sweep_cost.py``):

1. writes ``--rows`` chained audit rows in bulk (hashed here with ``audit.chain``, then COPY on
   PostgreSQL, executemany on SQLite), like a sweep's and a job's rows, a millisecond apart;
2. the write cost: ``--seconds`` of one-row service transactions (``audited_atomic()`` +
   ``audit_record``: the row's INSERT, unsealed) by 1, 2 and 4 threads at once (SQLite: 1, it has one
   writer), this process's sealer thread off; then ``seal_chain()`` over the rows they wrote, timed;
3. ``verify_audit`` over the whole chain, then ``--since`` the middle (half the rows).
"""

import argparse
import io
import json
import os
import sys
import threading
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_cost import scratch_database  # noqa: E402

COLUMNS = (
    "seq", "created_at", "actor_type", "actor_id", "actor_name", "action",
    "target_type", "target_id", "details", "client_ip", "success", "chain_hash",
)  # fmt: skip
BASE = datetime(2025, 1, 1, tzinfo=timezone.utc)


def chained_rows(count, start_seq, previous):
    """Yield ``count`` rows (``COLUMNS``), chained after ``previous``; the last hash is in the last row."""
    from audit.chain import chain_key, link_hash

    key = chain_key()
    for n in range(count):
        seq = start_seq + n
        if n % 3 == 2:
            row = [seq, BASE + timedelta(milliseconds=n), "system", "", "sweep", "job.requeued", "job", f"j_{n:012x}",
                   {"reason": "worker lost: no heartbeat for 120 s", "retry": n % 4, "worker": f"w_{n % 997:012x}"},
                   None, True]  # fmt: skip
        else:
            row = [seq, BASE + timedelta(milliseconds=n), "worker", f"w_{n % 997:012x}", f"gpu-{n % 997}",
                   "job.status_changed", "job", f"j_{n:012x}",
                   {"from": "running", "to": "completed", "progress": 1.0, "loss": 0.125 + n % 7 / 100},
                   "10.0.%d.%d" % (n % 250, n % 200), True]  # fmt: skip
        previous = link_hash(key, previous, row)
        yield [*row, previous]


def populate(db, count):
    """Append ``count`` chained rows after the chain head in bulk; return the seconds it took."""
    from django.db import connection, transaction

    from audit.sweeps import _MOVE_HEAD, _lock_head

    started = time.perf_counter()
    with transaction.atomic():
        seq, previous = _lock_head()
        rows = chained_rows(count, seq + 1, previous)
        table = connection.ops.quote_name("audit_auditevent")
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor, cursor.cursor.copy(f"COPY {table} ({', '.join(COLUMNS)}) FROM STDIN") as copy:
                for row in rows:
                    row[8] = json.dumps(row[8])
                    copy.write_row(row)
                    last = row
        else:
            marks = ", ".join(["%s"] * len(COLUMNS))
            sql = f"INSERT INTO {table} ({', '.join(COLUMNS)}) VALUES ({marks})"
            adapt = connection.ops.adapt_datetimefield_value
            with connection.cursor() as cursor:
                batch = []
                for row in rows:
                    row[1], row[8] = adapt(row[1]), json.dumps(row[8])
                    batch.append(row)
                    if len(batch) == 10000:
                        cursor.executemany(sql, batch)
                        last, batch = batch[-1], []
                if batch:
                    cursor.executemany(sql, batch)
                    last = batch[-1]
        with connection.cursor() as cursor:
            cursor.execute(_MOVE_HEAD, [last[0], last[-1], 1])
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    return time.perf_counter() - started


def write_rate(threads, seconds):
    """Return audit rows committed per second by ``threads`` threads each writing one-row transactions."""
    from django.db import connection

    from audit.services import Actor, audit_record, audited_atomic

    actor = Actor("user", "1", "operator", "10.1.2.3")
    counts = [0] * threads
    deadline = time.perf_counter() + seconds
    barrier = threading.Barrier(threads)

    def run(index):
        try:
            barrier.wait()
            n = 0
            while time.perf_counter() < deadline:
                with audited_atomic():
                    audit_record(actor=actor, action="job.cancelled", target_type="job", target_id=f"j_{n}",
                                 details={"reason": "operator"})  # fmt: skip
                n += 1
            counts[index] = n
        finally:
            connection.close()

    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(counts) / seconds


def seal_rate():
    """Seal every unsealed row; return (rows sealed, rows per second)."""
    from audit.sweeps import seal_chain

    started = time.perf_counter()
    sealed = seal_chain()["sealed"]
    return sealed, sealed / (time.perf_counter() - started)


def verify(*args):
    """Run verify_audit; return (seconds, its output line)."""
    from django.core.management import call_command

    out = io.StringIO()
    started = time.perf_counter()
    call_command("verify_audit", *args, stdout=out)
    return time.perf_counter() - started, " | ".join(out.getvalue().strip().splitlines())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--seconds", type=float, default=5)
    parser.add_argument("--writers", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    with scratch_database("st_audit_bench_") as db:
        from django.db import connection

        from audit.sweeps import SEALER

        SEALER.enabled = False  # the writes are timed without a sealer beside them; the sealing on its own

        with connection.cursor() as cursor:
            print(f"{db.describe(cursor)}, Python {sys.version.split()[0]}, {os.cpu_count()} CPUs", flush=True)
        print(f"populate {args.rows} chained rows: {populate(db, args.rows):.1f} s", flush=True)
        writers = args.writers if connection.vendor == "postgresql" else [1]
        for threads in writers:
            written = write_rate(threads, args.seconds)
            sealed, rate = seal_rate()
            print(f"write, {threads} thread(s): {written:7.0f} rows/s committed; then {sealed} sealed at {rate:7.0f} rows/s",
                  flush=True)  # fmt: skip
        seconds, line = verify()
        print(f"verify_audit (all): {seconds:.1f} s -- {line}", flush=True)
        middle = (BASE + timedelta(milliseconds=args.rows // 2)).isoformat()
        seconds, line = verify("--since", middle)
        print(f"verify_audit --since {middle}: {seconds:.1f} s -- {line}", flush=True)


if __name__ == "__main__":
    main()
