"""The services a test may need (PostgreSQL, Redis): skip without them, fail under CI=true."""

import os

import pytest


def missing_service(reason):
    """Skip the test for ``reason``, or fail it under CI=true (where every service must be there)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: a missing service is a failure)")
    pytest.skip(reason)


def require_service(name, env_var):
    """Return the URL in ``env_var``; skip (or, under CI=true, fail) without it."""
    if not os.environ.get(env_var):
        missing_service(f"{name} not configured: set {env_var} to run this test")
    return os.environ[env_var]


def require_postgres_url():
    """Return DATABASE_URL if it names PostgreSQL; skip (or, under CI=true, fail) otherwise."""
    url = require_service("PostgreSQL", "DATABASE_URL")
    if not url.startswith(("postgres://", "postgresql://")):
        missing_service(f"DATABASE_URL is not PostgreSQL ({url.split(':', 1)[0]})")
    return url


def require_redis_url():
    return require_service("Redis", "REDIS_URL")


def another_backend_waits_for_a_lock():
    """On PostgreSQL, return True once another backend of this database waits for a lock (a row's, say)."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")  # the view is otherwise frozen per transaction
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND wait_event_type = 'Lock' AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0] > 0
