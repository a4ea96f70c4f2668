"""The fleet simulator (bench/fleet.py) works end to end: a few seconds of each measurement, never timings."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.e2e


def run_smoke(tmp_path, servers, env):
    out = tmp_path / "fleet.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "fleet.py"), "--smoke", "--servers", servers, "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "lifecycle jobs/s" in proc.stdout  # the table
    return json.loads(out.read_text())


def check_single_process(r, config):
    assert r["config"] == config
    for key in ("latency_0", "latency_fleet"):
        assert r[key]["n"] == 3 and r[key]["p50_ms"] > 0 and r[key]["off_measured"] == 0
        assert r[key]["lost"] == 0  # ours never drops a submit (the simulator counts and goes on if one does)
    assert r["latency_fleet"]["fleet"] == 5
    assert r["throughput"]["jobs_completed"] > 0 and r["throughput"]["errors"] == 0
    assert r["heartbeats"]["failed"] == 0 and r["heartbeats"]["n"] == 20
    assert r["idle_streams"]["streams"] == 5 and r["idle_streams"]["threads"] > 0
    # the hung worker's job went to the other worker (the time is a figure, not asserted)
    assert r["failover"]["other_worker"] is True and r["failover"]["seconds"] > 0


def test_fleet_smoke_sqlite(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    report = run_smoke(tmp_path, "sqlite", env)
    assert report["machine"]["cpus"] and report["parameters"]["smoke"] is True
    check_single_process(report["results"]["sqlite"],
                         {"server": "sqlite", "database": "sqlite", "redis": False, "processes": 1})


@pytest.mark.postgres
@pytest.mark.redis
def test_fleet_smoke_postgres_redis_two_processes(tmp_path, postgres_url, redis_url):
    report = run_smoke(tmp_path, "pg", dict(os.environ))
    r = report["results"]["pg"]
    check_single_process(r, {"server": "pg", "database": "postgresql", "redis": True, "processes": 1})
    so = r["scale_out"]
    assert so["config"]["processes"] == 2
    assert so["cross_process"]["n"] == 3 and so["same_process"]["n"] == 3
    # rotating the token through one process closed the stream held by the other
    assert so["token_rotation"]["rotate_status"] == 200
    assert so["token_rotation"]["stream_closed_after_s"] is not None
    # the lifecycle again with the workers and submits shared by both processes: jobs completed through each
    tp = so["throughput"]
    assert tp["processes"] == 2 and tp["errors"] == 0 and tp["reports_refused"] == 0
    assert tp["jobs_completed"] > 0


def run_dispatch_cost(env):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dispatch_cost.py"), "--runs", "3", "--workers", "3"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {line.split(" median")[0].strip(): line for line in proc.stdout.splitlines() if " median " in line}


def test_dispatch_cost_runs_and_each_operation_commits_once_on_sqlite():
    lines = run_dispatch_cost({k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")})
    # the dispatch and its stored job_submit in one commit; a completion and the next dispatch in one;
    # the same through the API (the token's authentication writes nothing within the minute)
    assert sorted(lines) == ["api completion", "api submit", "completion", "submit"], lines
    assert all(line.endswith("1 commit(s)") for line in lines.values()), lines


@pytest.mark.postgres
@pytest.mark.redis
def test_dispatch_cost_runs_and_each_operation_commits_once_on_postgres(postgres_url, redis_url):
    lines = run_dispatch_cost(dict(os.environ))
    assert sorted(lines) == ["api completion", "api submit", "completion", "submit"], lines
    assert all(line.endswith("1 commit(s)") for line in lines.values()), lines


def test_prepared_cost_runs_and_times_each_read_both_ways():
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "prepared_cost.py"), "--runs", "5"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    timed = [line.split(" median")[0].strip() for line in proc.stdout.splitlines() if " median " in line]
    assert timed == [f"{read}, {how}" for read in ("token authentication", "lock_job in a transaction")
                     for how in ("ORM", "prepared")], proc.stdout  # fmt: skip


@pytest.mark.postgres
def test_audit_insert_cost_times_a_transaction_and_the_sealing_on_postgres(postgres_url):
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "audit_insert_cost.py"), "--runs", "5", "--rounds", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    timed = [line.split("  ")[1].strip() for line in proc.stdout.splitlines() if line.startswith("  ")]
    assert timed == ["1 row(s) in a transaction", "4 row(s) in a transaction", "sealing, per row"], proc.stdout


@pytest.mark.postgres
@pytest.mark.redis
def test_audit_throughput_runs_two_servers_and_their_rows_end_up_sealed(postgres_url, redis_url):
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "audit_throughput.py"), "--clients", "4", "--duration", "2",
                           "--warmup", "1"], cwd=ROOT, env=dict(os.environ), capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    (line,) = [line for line in proc.stdout.splitlines() if line.lstrip().startswith("1  ")]
    fields = line.split()
    assert float(fields[2]) > 0  # commits/s
    assert "Not sealed yet: no rows. | Audit chain intact" in line, line  # every row sealed, the chain verified
