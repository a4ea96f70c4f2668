"""Measure what an idle worker SSE stream costs one daphne process: memory, threads, DB connections.

Usage:  python bench/stream_cost.py [--streams 2000] [--batch 200]

Creates N workers with tokens in a fresh SQLite data dir (or DATABASE_URL if set: use a scratch
database), starts one daphne process, opens N real streams over loopback from this process with
asyncio sockets, waits until each has received its ``stream-open`` event, then reads the server's
RSS, thread count and open database connections (SQLite: open file handles on the database file;
PostgreSQL: rows in pg_stat_activity for the database). Prints a table and a one-line summary.
"""

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker_agent import protocol  # noqa: E402 - importable once ROOT is on the path


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare(data_dir, count):
    """Migrate a fresh database and create ``count`` workers; return their plaintext tokens."""
    env = {**os.environ, "SIMPLETUNER_DATA_DIR": str(data_dir)}
    subprocess.run([sys.executable, "manage.py", "migrate", "-v0"], cwd=ROOT, env=env, check=True)
    script = (
        "import sys, django\n"
        "django.setup()\n"
        "from workers.models import Worker, TokenKind, WorkerStatus\n"
        "from workers.services import token_issue\n"
        f"workers = Worker.objects.bulk_create([Worker(name=f'bench-{{i}}', status=WorkerStatus.IDLE) for i in range({count})])\n"
        "for w in workers:\n"
        "    print(token_issue(kind=TokenKind.WORKER, worker=w)[1])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**env, "DJANGO_SETTINGS_MODULE": "simpletuner_site.settings"},
        check=True,
        capture_output=True,
        text=True,
    )
    return out.stdout.split()


async def open_stream(port, token, opened):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        (
            f"GET {protocol.STREAM_PATH} HTTP/1.1\r\n"
            f"Host: 127.0.0.1:{port}\r\n{protocol.WORKER_TOKEN_HEADER}: {token}\r\nAccept: text/event-stream\r\n\r\n"
        ).encode()
    )
    await writer.drain()
    buffered = b""
    while protocol.STREAM_OPEN.encode() not in buffered:
        chunk = await reader.read(65536)
        if not chunk:
            raise RuntimeError(f"stream closed before {protocol.STREAM_OPEN}: " + buffered[:200].decode(errors="replace"))
        buffered += chunk
    if b" 200 " not in buffered.split(b"\r\n", 1)[0]:
        raise RuntimeError(buffered.split(b"\r\n", 1)[0].decode())
    opened.append((reader, writer))


def db_connections(proc, data_dir):
    url = os.environ.get("DATABASE_URL", "")
    if url.startswith("postgres"):
        import psycopg

        dbname = url.rsplit("/", 1)[-1]
        with psycopg.connect(url.rsplit("/", 1)[0] + "/postgres", autocommit=True) as conn:
            return conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = %s", (dbname,)
            ).fetchone()[0]
    db = str(Path(data_dir) / "orchestrator.sqlite3")
    return sum(1 for f in proc.open_files() if f.path == db)


def sample(proc, data_dir):
    return {
        "rss_kb": proc.memory_info().rss // 1024,
        "threads": proc.num_threads(),
        "db_conns": db_connections(proc, data_dir),
    }


async def run(args):
    data_dir = Path(tempfile.mkdtemp(prefix="st-bench-"))
    print(f"preparing {args.streams} workers in {data_dir} ...", flush=True)
    tokens = prepare(data_dir, args.streams)
    port = free_port()
    env = {**os.environ, "SIMPLETUNER_DATA_DIR": str(data_dir), "SIMPLETUNER_LOG_LEVEL": "WARNING"}
    server = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "simpletuner_site.asgi:application"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        proc = psutil.Process(server.pid)
        # Warm up: one stream, so lazily created pools and the eventstream machinery exist.
        opened = []
        await open_stream(port, tokens[0], opened)
        base = sample(proc, data_dir)
        rows = [(1, base)]
        started = time.monotonic()
        i = 1
        while i < len(tokens):
            batch = tokens[i : i + args.batch]
            await asyncio.gather(*(open_stream(port, t, opened) for t in batch))
            i += len(batch)
            rows.append((len(opened), sample(proc, data_dir)))
        open_secs = time.monotonic() - started
        await asyncio.sleep(2)  # let anything lazily started settle, then measure the idle state
        idle = sample(proc, data_dir)
        rows.append((len(opened), idle))
        print(f"\n{'streams':>8} {'RSS MiB':>9} {'threads':>8} {'DB conns':>9}")
        for n, s in rows:
            print(f"{n:>8} {s['rss_kb'] / 1024:>9.1f} {s['threads']:>8} {s['db_conns']:>9}")
        per_stream_kb = (idle["rss_kb"] - base["rss_kb"]) / max(len(opened) - 1, 1)
        print(
            f"\n{len(opened)} idle streams: {per_stream_kb:.1f} KB per stream, "
            f"{idle['threads']} threads in total, {idle['db_conns']} DB connections held; "
            f"opened at {(len(opened) - 1) / open_secs:.0f} streams/s"
        )
        for _, writer in opened:
            writer.close()
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=2000)
    parser.add_argument("--batch", type=int, default=200)
    args = parser.parse_args()
    # Each stream is one socket on each side; make sure the limit allows it.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.streams * 2 + 1024)), hard))
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
