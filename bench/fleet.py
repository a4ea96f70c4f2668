"""Fleet simulator: N asyncio workers speaking the worker protocol over real HTTP to a real orchestrator.

One command measures every figure of issue 13, on each server in turn, and prints one table:

    python bench/fleet.py --servers peer,sqlite,pg --json bench-fleet.json     # ~10 minutes here

  peer    SimpleTuner's own orchestrator (../shared/peer; build it with its build.sh, PEER_VENV)
  sqlite  ours, `simpletuner server` on a fresh SQLite data dir, embedded mode
  pg      ours on a scratch PostgreSQL database next to DATABASE_URL's, with REDIS_URL (sweeps in a
          `manage.py run_sweeps` process, as Celery beat would run them)
  --base-url URL [--bearer TOKEN] [--server-pid PID]: any running server that speaks the protocol

Per server: dispatch latency (submit -> `job_submit` parsed by the worker, sequential) with 0 and with
--fleet idle workers holding streams; lifecycle throughput (--tp-workers instant workers, a no-op
backlog, --duration s); heartbeats (open loop at --hb-rate/s over the idle fleet); memory per idle
stream (--streams, RSS of the server process). Ours only, on a second start with short timers:
failover (a busy worker hangs; its job's `job_submit` on the other worker). With pg: scale-out (two
server processes on one database and Redis; submit through one, stream on the other; token rotation
through one closes the stream on the other; with throughput, the lifecycle again with the workers and
the submits shared by both processes, as a balancer in front of them would share them). --smoke: a few seconds of each on SQLite (the test suite's
check that the harness works). Load average is recorded with every figure: the machine is shared.
"""

import argparse
import asyncio
import datetime
import json
import os
import platform
import signal
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import fleet_scenarios as sc  # noqa: E402
from fleet_http import Client  # noqa: E402
from fleet_servers import server_for  # noqa: E402
from fleet_sim import Fleet  # noqa: E402

SCENARIOS = ("latency", "throughput", "streams", "heartbeats", "failover", "scale-out")
SHORT_TIMERS = {"SIMPLETUNER_HEARTBEAT_INTERVAL": "0.5", "SIMPLETUNER_HEALTH_CHECK_INTERVAL": "0.5"}


def load():
    return round(os.getloadavg()[0], 2)


class External:
    """A server started by someone else, at --base-url."""

    kind, database, redis_url, processes = "external", "unknown", None, 1

    def __init__(self, url, bearer=None, pid=None):
        self.url, self.bearer, self.pid = url.rstrip("/"), bearer, pid

    def urls(self):
        return [self.url]

    def admin_headers(self):
        return {"Authorization": f"Bearer {self.bearer}"} if self.bearer else {}

    def server_pids(self):
        return [self.pid] if self.pid else []

    def db_connections(self):
        return None

    def start(self):
        return self

    def stop(self):
        pass


async def measure(server, a):
    """Every single-process figure on one running server."""
    fleet = Fleet(server)
    out = {}
    try:
        await fleet.add(1, sc.MEASURED, prefix="lat", heartbeat=30)
        if "latency" in a.only:
            out["latency_0"] = {**await sc.dispatch_latency(fleet, n=a.n, warmup=a.warmup), "load": load()}
        if "throughput" in a.only:
            out["throughput"] = {**await sc.throughput(fleet, workers=a.tp_workers, duration=a.duration), "load": load()}
        if not {"latency", "heartbeats", "streams"} & set(a.only):
            return out
        await asyncio.sleep(2)  # what the last step left (event storage, on-commit dispatches) settles
        before = sc.server_sample(server) if server.server_pids() else None
        await fleet.add(a.fleet, {"role": "fleet"}, prefix="fleet", heartbeat=30)
        if "latency" in a.only:
            out["latency_fleet"] = {**await sc.dispatch_latency(fleet, n=a.n, warmup=a.warmup), "load": load()}
        if before is not None and "streams" in a.only:  # before the heartbeat storm, which leaves work behind
            out["idle_streams"] = {**await sc.idle_streams(fleet, server, streams=max(a.streams, a.fleet),
                                                           before=before), "load": load()}
        if "heartbeats" in a.only:
            out["heartbeats"] = {**await sc.heartbeats(fleet, rate=a.hb_rate, duration=a.hb_duration), "load": load()}
    finally:
        fleet.close()
    return out


async def measure_failover(server, timeout):
    fleet = Fleet(server)
    try:
        return {**await sc.failover(fleet, timeout=timeout), "load": load()}
    finally:
        fleet.close()


async def measure_scale_out(server, a):
    """Two processes: the measured worker streams from B; submits go through B (same) and through A (cross)."""
    a_url, b_url = server.urls()[:2]
    fleet = Fleet(server, base_url=a_url)
    via_b = Client(b_url)
    try:
        (worker,) = await fleet.add(1, sc.MEASURED, prefix="so", heartbeat=30, base_url=b_url)
        same = await sc.dispatch_latency(fleet, n=a.n, warmup=a.warmup, submit_client=via_b)
        cross = await sc.dispatch_latency(fleet, n=a.n, warmup=a.warmup)
        rotation = await sc.token_rotation(fleet, worker, via=fleet.client)
        ratio = round(cross["p50_ms"] / same["p50_ms"], 2) if same["p50_ms"] else None
        out = {"same_process": same, "cross_process": cross, "p50_ratio": ratio, "token_rotation": rotation,
               "load": load()}
        if "throughput" in a.only:  # the lifecycle again, its workers and submits shared by both processes
            out["throughput"] = {**await sc.throughput(fleet, workers=a.tp_workers, duration=a.duration,
                                                       base_urls=[a_url, b_url]), "load": load()}
        return out
    finally:
        via_b.close()
        fleet.close()


def config_of(server, name):
    return {"server": name, "database": server.database, "redis": bool(server.redis_url),
            "processes": server.processes}


async def run(a):
    results = {}
    if a.base_url:
        targets = [("external", lambda: External(a.base_url, a.bearer, a.server_pid))]
    else:
        db, redis = os.environ.get("DATABASE_URL", ""), os.environ.get("REDIS_URL", "")
        opts = {"sqlite": {}, "pg": {"database_url": db, "redis_url": redis}, "peer": {}}
        for name in a.servers:
            if name == "pg" and not (db.startswith("postgres") and redis):
                raise SystemExit("--servers pg needs DATABASE_URL (postgres://...) and REDIS_URL")
        targets = [(name, lambda name=name: server_for(name, **opts[name])) for name in a.servers]
    for name, make in targets:
        server = make()
        t0 = time.time()
        print(f"[{name}] starting (load {load()})", flush=True)
        server.start()
        print(f"[{name}] at {server.url}, server pids {server.server_pids()}", flush=True)
        try:
            results[name] = {"config": config_of(server, name), **await measure(server, a)}
        finally:
            server.stop()
        if name in ("sqlite", "pg") and "failover" in a.only:
            kw = {"database_url": os.environ.get("DATABASE_URL"), "redis_url": os.environ.get("REDIS_URL")} \
                if name == "pg" else {}
            timers = {**SHORT_TIMERS, "SIMPLETUNER_HEARTBEAT_TIMEOUT": str(a.failover_timeout)}
            server = server_for(name, timers=timers, **kw)
            server.start()
            try:
                results[name]["failover"] = await measure_failover(server, a.failover_timeout)
            finally:
                server.stop()
        if name == "pg" and "scale-out" in a.only:
            server = server_for("pg", database_url=os.environ["DATABASE_URL"], redis_url=os.environ["REDIS_URL"],
                                processes=2)
            server.start()
            try:
                results[name]["scale_out"] = {"config": config_of(server, name), **await measure_scale_out(server, a)}
            finally:
                server.stop()
        print(f"[{name}] done in {time.time() - t0:.0f} s", flush=True)
    return results


def fmt_lat(d):
    return "-" if not d or d.get("p50_ms") is None else f"{d['p50_ms']:.1f} / {d['p99_ms']:.1f} / {d['max_ms']:.0f}"


ROWS = [
    ("dispatch p50/p99/max ms, 0 idle", lambda r: fmt_lat(r.get("latency_0"))),
    ("dispatch p50/p99/max ms, fleet idle", lambda r: fmt_lat(r.get("latency_fleet"))),
    ("  (idle fleet size)", lambda r: str(r.get("latency_fleet", {}).get("fleet", "-"))),
    ("  submits never dispatched (lost)", lambda r: "-" if "latency_0" not in r else
     f"{r['latency_0'].get('lost', 0)} + {r.get('latency_fleet', {}).get('lost', 0)}"),
    ("lifecycle jobs/s", lambda r: str(r.get("throughput", {}).get("jobs_per_s", "-"))),
    ("  submit->completed p50/p99/max ms", lambda r: fmt_lat(r.get("throughput", {}).get("submit_to_completed"))),
    ("heartbeats answered/s (offered)", lambda r: "-" if "heartbeats" not in r else
     f"{r['heartbeats']['answered_per_s']} ({r['heartbeats']['offered_per_s']})"),
    ("  heartbeat p50/p99/max ms", lambda r: fmt_lat(r.get("heartbeats"))),
    ("idle streams: KB each (streams)", lambda r: "-" if "idle_streams" not in r else
     f"{r['idle_streams']['kb_per_stream']} ({r['idle_streams']['streams']})"),
    ("  threads / DB connections held", lambda r: "-" if "idle_streams" not in r else
     f"{r['idle_streams']['threads']} / {r['idle_streams']['db_connections']}"),
    ("failover s (bound)", lambda r: "-" if "failover" not in r else
     f"{r['failover']['seconds']} ({r['failover']['bound_s']})"),
    ("scale-out p50 cross / same ms", lambda r: "-" if "scale_out" not in r else
     f"{r['scale_out']['cross_process']['p50_ms']} / {r['scale_out']['same_process']['p50_ms']}"),
    ("  rotation closes other stream s", lambda r: "-" if "scale_out" not in r else
     str(r["scale_out"]["token_rotation"]["stream_closed_after_s"])),
    ("  lifecycle jobs/s over both processes", lambda r: str(r.get("scale_out", {}).get("throughput", {})
                                                             .get("jobs_per_s", "-"))),
]


def table(results):
    names = list(results)
    lines = [f"{'':38}" + "".join(f"{n:>26}" for n in names)]
    for label, get in ROWS:
        lines.append(f"{label:38}" + "".join(f"{get(results[n]):>26}" for n in names))
    return "\n".join(lines)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="sqlite", help="comma-separated: peer, sqlite, pg (default sqlite)")
    ap.add_argument("--base-url", help="drive this running server instead of starting any")
    ap.add_argument("--bearer", help="operator token for --base-url (ours); the peer needs none")
    ap.add_argument("--server-pid", type=int, help="pid of the --base-url server, for its memory")
    ap.add_argument("--n", type=int, default=60, help="timed submits per latency figure")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--fleet", type=int, default=1000, help="idle workers holding streams for the second latency")
    ap.add_argument("--streams", type=int, default=1000, help="idle streams for the memory figure (>= --fleet)")
    ap.add_argument("--tp-workers", type=int, default=200)
    ap.add_argument("--duration", type=float, default=30, help="seconds of lifecycle throughput")
    ap.add_argument("--hb-rate", type=float, default=1000, help="heartbeats offered per second")
    ap.add_argument("--hb-duration", type=float, default=10)
    ap.add_argument("--failover-timeout", type=float, default=2, help="heartbeat timeout of the failover run (s)")
    ap.add_argument("--only", default=",".join(SCENARIOS),
                    help=f"comma-separated subset of: {', '.join(SCENARIOS)} (default all)")
    ap.add_argument("--json", default="bench-fleet.json", help="where to write the results")
    ap.add_argument("--smoke", action="store_true", help="a few seconds of each figure on SQLite")
    a = ap.parse_args(argv)
    if a.smoke:
        a.n, a.warmup, a.fleet, a.streams, a.tp_workers, a.duration = 3, 1, 5, 5, 3, 2
        a.hb_rate, a.hb_duration, a.failover_timeout = 20, 1, 1
    a.servers = [s.strip() for s in a.servers.split(",") if s.strip()]
    a.only = [s.strip() for s in a.only.split(",") if s.strip()]
    if set(a.only) - set(SCENARIOS):
        ap.error(f"unknown scenarios: {', '.join(sorted(set(a.only) - set(SCENARIOS)))}")
    unknown = set(a.servers) - {"peer", "sqlite", "pg"}
    if unknown:
        ap.error(f"unknown servers: {', '.join(sorted(unknown))}")
    return a


def _interrupted(signum, frame):
    raise KeyboardInterrupt  # asyncio.run cancels the run, whose finally blocks stop the servers it started


def main(argv=None):
    a = parse(argv)
    signal.signal(signal.SIGTERM, _interrupted)
    started = datetime.datetime.now(datetime.timezone.utc)
    results = asyncio.run(run(a))
    report = {
        "date": started.isoformat(timespec="seconds"),
        "machine": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "parameters": {k: v for k, v in vars(a).items() if k not in ("json", "bearer")},
        "results": results,
    }
    Path(a.json).write_text(json.dumps(report, indent=2))
    print(table(results))
    print(f"\nwritten to {a.json}")


if __name__ == "__main__":
    main()
