"""CPU time of one audited transaction on PostgreSQL (its rows saved unsealed), and of sealing a row afterwards.

Usage:  DATABASE_URL=postgres://... python bench/audit_insert_cost.py [--runs 600] [--rounds 3]

Times ``audited_atomic()`` around ``audit_write`` of 1 and of 4 rows (one ``bulk_create``: a plain INSERT
for one row, UNNEST of arrays for more), in this thread's CPU time (``time.thread_time``: the client's
own work, psycopg's adaptation included, without the waits on the server), median of ``--runs`` per
round, with this process's sealer thread off; then ``seal_chain()`` over the rows that round wrote (the
sealer's work, off the request's path), per row. Builds a scratch database like ``sweep_cost.py``.
"""

import argparse
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
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with scratch_database("st_audit_insert_") as db:
        from django.db import connection

        import audit.services as services
        from audit.sweeps import SEALER, seal_chain

        SEALER.enabled = False  # no sealer thread beside the timed transactions: the sealing is timed on its own

        if connection.vendor != "postgresql":
            sys.exit("PostgreSQL only (set DATABASE_URL)")
        actor = services.Actor.system("bench")

        def audited(rows):
            with services.audited_atomic():
                services.audit_write(
                    services.audit_events(
                        actor=actor, action="job.requeued", target_type="job", rows=[(f"j_{n}", {"n": n}) for n in range(rows)]
                    )
                )

        results = {}
        for _ in range(args.rounds):
            written = 0
            for rows in (1, 4):
                for _ in range(50):
                    audited(rows)
                cpu = []
                for _ in range(args.runs):
                    started = time.thread_time()
                    audited(rows)
                    cpu.append(time.thread_time() - started)
                written += (50 + args.runs) * rows
                results.setdefault(f"{rows} row(s) in a transaction", []).append(statistics.median(cpu) * 1000)
            started = time.thread_time()
            sealed = seal_chain()["sealed"]
            results.setdefault("sealing, per row", []).append((time.thread_time() - started) * 1000 / sealed)
            assert sealed == written, (sealed, written)
        with connection.cursor() as cursor:
            where = db.describe(cursor)
        print(f"{where}; median CPU ms of one audited transaction, and of sealing one row, per round")
        for what, medians in results.items():
            print(f"  {what:26}  " + "  ".join(f"{m:.3f}" for m in medians))


if __name__ == "__main__":
    main()
