"""Fixtures shared by every test suite: operators, workers, captured events, required services."""

import pytest

from tests.services import require_postgres_url, require_redis_url

# The API clients, operators and commit helper used by the workers, job_queue and audit suites.
pytest_plugins = ["workers.tests.support"]


@pytest.fixture
def postgres_url():
    return require_postgres_url()


@pytest.fixture
def redis_url():
    return require_redis_url()


@pytest.fixture(scope="session")
def sqlite_test_database_in_memory():
    """Spell out the in-memory test database that Django gives an SQLite database without a TEST NAME."""
    from django.conf import settings

    for database in settings.DATABASES.values():
        test = database.setdefault("TEST", {})
        if database["ENGINE"] == "common.db.sqlite3" and not test.get("NAME"):
            test["NAME"] = ":memory:"


@pytest.fixture(scope="session")
def django_db_modify_db_settings_xdist_suffix(
    sqlite_test_database_in_memory, django_db_modify_db_settings_xdist_suffix
):
    """pytest-django's test database suffix per pytest-xdist worker (make test-fast), SQLite's name spelt out first.

    pytest-django knows SQLite only by Django's own ENGINE; without the name it would move this project's
    (common.db.sqlite3) test database from memory, which is each worker process's own, to a file it
    cannot open. A PostgreSQL test database still gets the worker's suffix.
    """


@pytest.fixture(autouse=True)
def no_audit_sealer_thread(monkeypatch):
    """No test process runs the audit sealer's thread (it would write beside the test): a test seals the chain
    (``audit.sweeps.seal_chain``) when it means to, and the servers of end-to-end tests run their own."""
    monkeypatch.setattr("audit.sweeps.SEALER.enabled", False)


@pytest.fixture(autouse=True)
def artifact_storage_dir(request, tmp_path_factory):
    """Every test keeps the artifacts it uploads in a directory of its own (not the data directory's)."""
    if "settings" not in request.fixturenames and not request.node.get_closest_marker("django_db"):
        yield None
        return
    settings = request.getfixturevalue("settings")
    location = tmp_path_factory.mktemp("artifacts")
    settings.STORAGES = {
        **settings.STORAGES,
        "artifacts": {"BACKEND": "django.core.files.storage.FileSystemStorage", "OPTIONS": {"location": str(location)}},
    }
    yield location
