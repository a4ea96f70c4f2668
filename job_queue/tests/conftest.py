"""Fixtures for this suite; they are defined once in workers.tests.support."""

from workers.tests.support import (  # noqa: F401
    api_client,
    bearer_client,
    commit,
    operator,
    operator_client,
    static_root,
    user_client,
    worker_client,
)
