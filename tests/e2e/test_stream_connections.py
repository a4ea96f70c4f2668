"""Open streams hold no database connection, whichever handler serves them (fast paths on or off).

With ``SIMPLETUNER_FAST_PATHS=off`` Django's own handler gives each stream a thread for its whole life, and
the library's stream reads storage there: a connection left open in that thread was held per stream, so on
PostgreSQL the pool ran dry after ``SIMPLETUNER_DB_POOL_SIZE`` streams and every other request failed after
the pool's 30 s (``bench/fleet.py`` with the fast paths off, 2026-11-28).
"""

import time

import pytest

from .harness import Fleet, Orchestrator, create_database, drop_database, expect

POOL_SIZE = 2
STREAMS = 3 * POOL_SIZE


@pytest.mark.e2e
@pytest.mark.postgres
@pytest.mark.redis
@pytest.mark.parametrize("fast_paths", ["on", "off"])
def test_more_streams_than_pooled_connections_leave_the_server_answering(tmp_path, postgres_url, redis_url, fast_paths):
    database_url = create_database(postgres_url)
    env = {"SIMPLETUNER_FAST_PATHS": fast_paths, "SIMPLETUNER_DB_POOL_SIZE": str(POOL_SIZE)}
    server = Orchestrator(
        backend="postgres", data_dir=tmp_path, database_url=database_url, redis_url=redis_url, extra_env=env
    ).start()
    fleet = Fleet(server, f"pool-{fast_paths}")
    try:
        for _ in range(STREAMS):
            fleet.open_stream(fleet.create_worker())

        started = time.monotonic()
        expect(server.admin("GET", "/api/queue/", timeout=10), 200)
        worker = expect(server.admin("GET", f"/api/admin/workers/{fleet.workers[0].id}", timeout=10), 200)

        assert time.monotonic() - started < 5, server.read_log()
        assert worker["stream_connected"] is True
    finally:
        fleet.cleanup()
        server.stop()
        drop_database(postgres_url, database_url)
