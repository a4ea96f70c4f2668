"""Fixtures for end-to-end tests: one real orchestrator per backend per session, and a per-test fleet.

These tests never use pytest-django's test database: each server owns its database (SQLite in a tmp
data dir, or a brand-new PostgreSQL database) and is reached only over HTTP.
"""

import pytest

from .agent_harness import AgentRunner, write_import_blocker
from .harness import Fleet, Orchestrator, create_database, drop_database

_SERVER = pytest.StashKey()


class OrchestratorPool:
    """Starts at most one orchestrator per backend, on first use; stops them (and drops databases) at the end."""

    def __init__(self, tmp_path_factory):
        self.tmp_path_factory = tmp_path_factory
        self.servers = {}
        self.failures = {}
        self.databases = []  # (server_url, database_url)

    def get(self, backend, *, database_url=None, redis_url=None):
        if backend in self.failures:
            pytest.fail(f"the {backend} orchestrator failed to start earlier:\n{self.failures[backend]}", pytrace=False)
        if backend not in self.servers:
            try:
                self.servers[backend] = self._start(backend, database_url, redis_url)
            except Exception as exc:
                self.failures[backend] = f"{type(exc).__name__}: {exc}"
                raise
        return self.servers[backend]

    def _start(self, backend, database_url, redis_url):
        data_dir = self.tmp_path_factory.mktemp(f"orchestrator-{backend}")
        run_db = None
        if database_url:
            run_db = create_database(database_url)
            self.databases.append((database_url, run_db))
        server = Orchestrator(backend=backend, data_dir=data_dir, database_url=run_db, redis_url=redis_url)
        return server.start()

    def close(self):
        for server in self.servers.values():
            server.stop()
        for server_url, database_url in self.databases:
            drop_database(server_url, database_url)


@pytest.fixture(scope="session")
def orchestrator_pool(tmp_path_factory):
    pool = OrchestratorPool(tmp_path_factory)
    yield pool
    pool.close()


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
    ]
)
def orchestrator(request, orchestrator_pool):
    """A running orchestrator: (a) embedded default (SQLite, no Redis), (b) PostgreSQL + Redis from the env."""
    if request.param == "postgres":
        postgres_url = request.getfixturevalue("postgres_url")  # skips (fails under CI=true) without it
        redis_url = request.getfixturevalue("redis_url")
        server = orchestrator_pool.get("postgres", database_url=postgres_url, redis_url=redis_url)
    else:
        server = orchestrator_pool.get("sqlite")
    if not server.is_alive():
        pytest.fail(f"the {server.backend} orchestrator is no longer running:\n{server.read_log()}", pytrace=False)
    request.node.stash[_SERVER] = (server, server.log_size())
    return server


@pytest.fixture
def fleet(request, orchestrator):
    """Workers and streams for one test, named uniquely; streams closed and workers taken offline afterwards."""
    fleet = Fleet(orchestrator, request.node.originalname.removeprefix("test_").replace("_", "-"))
    yield fleet
    fleet.cleanup()


@pytest.fixture(scope="module")
def blocker_dir(tmp_path_factory):
    """A directory whose ``sitecustomize`` makes Django and the orchestrator's packages unimportable to agents."""
    return write_import_blocker(tmp_path_factory.mktemp("no-django"))


@pytest.fixture
def agents(orchestrator, fleet, tmp_path, blocker_dir):
    """Real agent processes for one test against ``orchestrator``; all killed (their logs shown) afterwards."""
    runner = AgentRunner(orchestrator, fleet, tmp_path, blocker_dir=blocker_dir)
    yield runner
    runner.cleanup()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach this test's slice of the server log to a failing test's report."""
    report = yield
    entry = item.stash.get(_SERVER, None)
    if entry is not None and report.failed:
        server, offset = entry
        report.sections.append((f"orchestrator log ({server.backend}, {server.log_path})", server.read_log(offset)))
    return report
