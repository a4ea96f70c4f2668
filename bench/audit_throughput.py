"""Audited commits per second from concurrent clients over two server processes, and how long a row waits to be sealed.

Usage:  DATABASE_URL=postgres://... REDIS_URL=redis://... python bench/audit_throughput.py \
            [--clients 16] [--duration 20] [--warmup 3] [--rounds 1] [--tree PATH ...]

Per round and per source tree (``--tree``, default this checkout; give several, e.g. a ``git worktree`` of
the code before a change and one after, and they are measured in turn, interleaved over the rounds):
``--processes`` (2) ``simpletuner server`` processes on a scratch PostgreSQL database next to
DATABASE_URL's, with REDIS_URL and a ``manage.py run_sweeps`` process beside them, as Celery beat would
run the sweeps (``bench/fleet_servers.py``). Every server runs from that tree with this interpreter.
``--clients`` keep-alive clients, each bound to one server in turn, submit jobs no worker can take
(``POST /api/queue/submit``: one transaction, its audit row included, a commit each) as fast as they are
answered, for ``--warmup`` then ``--duration`` seconds. Printed per run:

- audited commits/s: submits answered 201 during ``--duration``, per second;
- the request's p50/p99 latency;
- the sealing lag: from the answer to a submit (its transaction had committed) to the first look at
  the database, every ``--poll`` seconds, that finds its audit row sealed (a ``seq``): an upper bound,
  within one poll. A tree that seals in the request's own transaction shows only the poll's resolution;
- the rows still unsealed when the load stops and how long until none is; ``verify_audit``'s verdict.
"""

import argparse
import asyncio
import datetime
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import fleet_servers  # noqa: E402
from fleet_http import Client  # noqa: E402
from fleet_sim import job_id_of  # noqa: E402

UNSEALED = "SELECT target_id FROM audit_auditevent WHERE seq IS NULL AND action = 'job.submitted'"


def percentile(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


class SealWatch:
    """Polls the scratch database every ``interval`` s for the submitted rows not sealed yet, on a thread."""

    def __init__(self, url, interval):
        import psycopg

        self.conn = psycopg.connect(url, autocommit=True)
        self.interval = interval
        self.looks = []  # (perf_counter when the answer came back, set of job ids unsealed)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="seal-watch", daemon=True)

    def _run(self):
        while not self.stop.is_set():
            unsealed = {row[0] for row in self.conn.execute(UNSEALED)}
            self.looks.append((time.perf_counter(), unsealed))
            self.stop.wait(self.interval)

    def sealed_after(self, job_id, answered):
        """Return the seconds from ``answered`` to the first look after it that found ``job_id`` sealed."""
        for at, unsealed in self.looks:
            if at > answered and job_id not in unsealed:
                return at - answered
        return None


async def load(urls, headers, clients, warmup, duration):
    """Run ``clients`` submitters; return [(job id, perf_counter answered, seconds)] of the measured window."""
    pools = [Client(url) for url in urls]
    started = time.perf_counter()
    measure_from, until = started + warmup, started + warmup + duration
    done = []

    async def submitter(index):
        client = pools[index % len(pools)]
        n = 0
        while time.perf_counter() < until:
            body = {"config_name": "bench", "target": "worker", "worker_labels": {"bench": f"nobody-{index}-{n}"}}
            status, data, seconds = await client.request("POST", "/api/queue/submit", headers=headers, json_body=body)
            answered = time.perf_counter()
            if status != 201:
                raise RuntimeError(f"submit answered {status}: {data}")
            if answered >= measure_from and answered < until:
                done.append((job_id_of(data), answered, seconds))
            n += 1

    try:
        await asyncio.gather(*(submitter(i) for i in range(clients)))
    finally:
        for client in pools:
            client.close()
    return done


def one_run(tree, a, redis_url):
    fleet_servers.ROOT = tree  # the servers, migrate and run_sweeps start from this tree (their cwd)
    server = fleet_servers.Ours(database_url=os.environ["DATABASE_URL"], redis_url=redis_url, processes=a.processes)
    server.start()
    try:
        watch = SealWatch(server.scratch.url, a.poll)
        watch.thread.start()
        load_before = os.getloadavg()[0]
        done = asyncio.run(load(server.urls(), server.admin_headers(), a.clients, a.warmup, a.duration))
        stopped = time.perf_counter()
        unsealed_at_stop = len(watch.looks[-1][1]) if watch.looks else 0
        deadline = stopped + 30
        while time.perf_counter() < deadline and (not watch.looks or watch.looks[-1][0] < stopped or watch.looks[-1][1]):
            time.sleep(a.poll)
        drained = watch.looks[-1][0] - stopped if watch.looks and not watch.looks[-1][1] else None
        watch.stop.set()
        watch.thread.join(5)
        lags = [lag for job_id, answered, _ in done if (lag := watch.sealed_after(job_id, answered)) is not None]
        verify = subprocess.run([sys.executable, "manage.py", "verify_audit"], cwd=tree, env=server.env,
                                capture_output=True, text=True)  # fmt: skip
        verdict = " | ".join((verify.stdout + verify.stderr).strip().splitlines()) or f"exit {verify.returncode}"
        return {
            "tree": str(tree),
            "commits_per_s": len(done) / a.duration,
            "p50_ms": statistics.median(s for *_, s in done) * 1000,
            "p99_ms": percentile([s for *_, s in done], 99) * 1000,
            "lag_p50_ms": percentile(lags, 50) * 1000,
            "lag_p99_ms": percentile(lags, 99) * 1000,
            "lag_max_ms": max(lags, default=float("nan")) * 1000,
            "lags": len(lags),
            "unsealed_at_stop": unsealed_at_stop,
            "drained_s": drained,
            "verify": verdict,
            "load": round((load_before + os.getloadavg()[0]) / 2, 2),
        }
    finally:
        server.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--duration", type=float, default=20)
    parser.add_argument("--warmup", type=float, default=3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--poll", type=float, default=0.02, help="seconds between looks for unsealed rows")
    parser.add_argument("--tree", action="append", type=Path, help="a source tree to run the servers from")
    a = parser.parse_args()
    if not os.environ.get("DATABASE_URL", "").startswith("postgres"):
        sys.exit("PostgreSQL only: set DATABASE_URL (a scratch database is made next to it) and REDIS_URL")
    redis_url = os.environ.get("REDIS_URL") or sys.exit("set REDIS_URL: two server processes share events through it")
    trees = [t.resolve() for t in (a.tree or [HERE.parent])]
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}; {a.processes} server processes, {a.clients} clients, "
          f"{a.duration:g} s after {a.warmup:g} s of warm-up", flush=True)  # fmt: skip
    print("round  tree                          commits/s  p50 ms  p99 ms  lag p50/p99/max ms   unsealed at stop, "
          "drained in  load  verify_audit", flush=True)  # fmt: skip
    for round_ in range(1, a.rounds + 1):
        for tree in trees:
            r = one_run(tree, a, redis_url)
            drained = "-" if r["drained_s"] is None else f"{r['drained_s']:.2f} s"
            print(f"{round_:>5}  {str(tree)[-28:]:28}  {r['commits_per_s']:9.1f}  {r['p50_ms']:6.1f}  {r['p99_ms']:6.1f}  "
                  f"{r['lag_p50_ms']:5.0f}/{r['lag_p99_ms']:5.0f}/{r['lag_max_ms']:5.0f}   {r['unsealed_at_stop']:5d}, "
                  f"{drained:>8}  {r['load']:4.1f}  {r['verify']}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
