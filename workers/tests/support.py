"""Fixtures and helpers shared by the workers, job_queue and audit test suites.

The root conftest.py loads this module as a pytest plugin, so every suite sees its fixtures.
"""

import json
import logging
import os
from contextlib import contextmanager

import pytest
from django.conf import settings
from django_eventstream.models import Event
from rest_framework.test import APIClient

from audit.models import AuditEvent
from workers.events import worker_channel

from .factories import UserFactory, api_token, worker_token

# Loggers on which Django reports an exception raised by a robust on_commit callback.
ON_COMMIT_ERROR_LOGGERS = ("django.test", "django.db.backends.base")


def sent_events(worker_id=None):
    """Return what django-eventstream stored, oldest first, as ``{"channel", "type", "data"}`` dicts.

    Only reliable (stored) channels appear; the library's ``eid=0`` placeholder rows are left out.
    """
    rows = Event.objects.filter(eid__gt=0).order_by("id")
    if worker_id is not None:
        rows = rows.filter(channel=worker_channel(worker_id))
    return [{"channel": e.channel, "type": e.type, "data": _decode(e.data)} for e in rows]


def _decode(stored):
    # send_event JSON-encodes the payload, then DjangoModelStorage JSON-encodes that string again.
    data = json.loads(stored)
    return json.loads(data) if isinstance(data, str) else data


def audit_rows(action=None, **filters):
    """Return audit rows (oldest first), optionally only those of ``action``."""
    rows = AuditEvent.objects.filter(**filters).order_by("id")
    if action is not None:
        rows = rows.filter(action=action)
    return list(rows)


@pytest.fixture(autouse=True, scope="session")
def static_root():
    """WhiteNoise warns on every request when STATIC_ROOT is missing; tests never collect static files."""
    os.makedirs(settings.STATIC_ROOT, exist_ok=True)


@pytest.fixture
def commit(django_capture_on_commit_callbacks, caplog):
    """``with commit(): ...`` runs the on_commit callbacks registered inside, as a real commit would.

    Callbacks registered by those callbacks run too. A robust callback's exception would only be
    logged by Django; here it fails the test.
    """

    @contextmanager
    def _commit():
        caplog.set_level(logging.ERROR)
        before = len(caplog.records)
        with django_capture_on_commit_callbacks(execute=True) as callbacks:
            yield callbacks
        errors = [
            r.getMessage()
            for r in caplog.records[before:]
            if r.name in ON_COMMIT_ERROR_LOGGERS and r.levelno >= logging.ERROR
        ]
        assert not errors, f"an on_commit callback raised: {errors}"

    return _commit


def _json_client():
    client = APIClient()
    client.default_format = "json"
    return client


@pytest.fixture
def api_client():
    """An API client with no credentials."""
    return _json_client()


@pytest.fixture
def bearer_client():
    """``bearer_client(user)``: an API client sending ``Authorization: Bearer sta_...`` for ``user``."""

    def _make(user):
        client = _json_client()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {api_token(user)}")
        return client

    return _make


@pytest.fixture
def worker_client():
    """``worker_client(worker)``: an API client sending the worker's own ``X-Worker-Token``."""

    def _make(worker, token=None):
        client = _json_client()
        client.credentials(HTTP_X_WORKER_TOKEN=token or worker_token(worker))
        return client

    return _make


@pytest.fixture
def operator():
    """A user allowed to manage workers and read the audit log (not a superuser)."""
    return UserFactory(permissions=["workers.manage_workers", "audit.view_auditevent"])


@pytest.fixture
def operator_client(bearer_client, operator):
    return bearer_client(operator)


@pytest.fixture
def user_client(bearer_client):
    """An authenticated operator without any model permission (may use the queue API only)."""
    return bearer_client(UserFactory())
