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
