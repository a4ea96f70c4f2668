"""CPU time of one audited transaction on PostgreSQL, its rows sent as a multi-row VALUES or as UNNEST of arrays.

Usage:  DATABASE_URL=postgres://... python bench/audit_insert_cost.py [--runs 600] [--rounds 3]

``audit.services._insert`` sends a request's few rows as plain VALUES and a sweep's many as one array
per column (``_ROWS_PER_VALUES_POSTGRES``). This times ``audited_atomic()`` around ``audit_write`` of 1
and of 4 rows with each form, in this thread's CPU time (``time.thread_time``: the client's own work,
psycopg's adaptation included, without the waits on the server), median of ``--runs`` per round.
Builds a scratch database like ``sweep_cost.py``.
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

        if connection.vendor != "postgresql":
            sys.exit("PostgreSQL only (set DATABASE_URL): elsewhere the rows always go as VALUES")
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
            for form, values_up_to in (("arrays", 0), ("values", 32)):
                services._ROWS_PER_VALUES_POSTGRES = values_up_to
                for rows in (1, 4):
                    for _ in range(50):
                        audited(rows)
                    cpu = []
                    for _ in range(args.runs):
                        started = time.thread_time()
                        audited(rows)
                        cpu.append(time.thread_time() - started)
                    results.setdefault((rows, form), []).append(statistics.median(cpu) * 1000)
        with connection.cursor() as cursor:
            where = db.describe(cursor)
        print(f"{where}; median CPU ms of one audited transaction, per round")
        for (rows, form), medians in sorted(results.items()):
            print(f"  {rows} row(s) as {form:6}  " + "  ".join(f"{m:.3f}" for m in medians))


if __name__ == "__main__":
    main()
