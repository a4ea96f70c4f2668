"""Fixtures shared by every test suite: operators, workers, captured events, required services."""

import os

import pytest

# The API clients, operators and commit helper used by the workers, job_queue and audit suites.
pytest_plugins = ["workers.tests.support"]


def require_service(name, env_var):
    """Skip (or, under CI=true, fail) unless ``env_var`` names the service the test needs."""
    if os.environ.get(env_var):
        return os.environ[env_var]
    reason = f"{name} not configured: set {env_var} to run this test"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: a missing service is a failure)")
    pytest.skip(reason)


@pytest.fixture
def postgres_url():
    url = require_service("PostgreSQL", "DATABASE_URL")
    if not url.startswith(("postgres://", "postgresql://")):
        reason = f"DATABASE_URL is not PostgreSQL ({url.split(':', 1)[0]})"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return url


@pytest.fixture
def redis_url():
    return require_service("Redis", "REDIS_URL")
