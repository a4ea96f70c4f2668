"""Fixtures and helpers shared by the workers, job_queue and audit test suites.

The root conftest.py loads this module as a pytest plugin, so every suite sees its fixtures.
"""

import json
import logging
import os
import re
from contextlib import contextmanager

import pytest
from django.conf import settings
from django.contrib.admin.utils import quote
from django.contrib.messages import get_messages
from django.http.request import HttpHeaders
from django.urls import reverse
from django_eventstream.models import Event
from rest_framework.test import APIClient

from audit.models import AuditEvent
from realtime.publish import worker_channel
from worker_agent import protocol

from .factories import UserFactory, api_token, worker_token

# Loggers on which Django reports an exception raised by a robust on_commit callback.
ON_COMMIT_ERROR_LOGGERS = ("django.test", "django.db.backends.base")


@pytest.fixture
def control_messages(monkeypatch):
    """Control messages (stream revocations) sent on commit, as ``(channel, type, data)``."""
    from realtime import publish

    sent = []

    def capture(channel, kind, data, **_options):
        if channel.startswith(publish.CONTROL_PREFIX):
            sent.append((channel, kind, data))

    monkeypatch.setattr(publish, "send_event", capture)
    return sent


@pytest.fixture
def pushed(monkeypatch):
    """What was pushed to the streams' listeners (the local ones; Redis is bypassed), as ``(channel, event)``.

    A worker event is stored in the transaction that announces it, and pushed only after its commit.
    """
    from django_eventstream import eventstream
    from django_eventstream.views import get_listener_manager

    seen = []
    monkeypatch.setattr(get_listener_manager(), "add_to_queues", lambda channel, event: seen.append((channel, event)))
    monkeypatch.setattr(eventstream, "redis_client", None)
    return seen


@pytest.fixture
def operator_changes(monkeypatch):
    """The ``changes`` events published on the operators' change feed on commit, as their data dicts."""
    from audit import events as audit_events
    from realtime import operator_feed

    sent = []
    monkeypatch.setattr(operator_feed, "publish", sent.append)
    # Targets of earlier tests' rolled-back transactions wait in this thread for the next event; drop them.
    audit_events._pending.targets = set()
    return sent


def sent_events(worker_id=None):
    """Return what django-eventstream stored, oldest first, as ``{"channel", "type", "data"}`` dicts.

    Only reliable (stored) channels appear; the library's ``eid=0`` placeholder rows are left out. An
    event is stored in the transaction that announced it (``realtime.storage``): what was pushed to the
    streams, and when, is the ``pushed`` fixture's.
    """
    rows = Event.objects.filter(eid__gt=0).order_by("id")
    if worker_id is not None:
        rows = rows.filter(channel=worker_channel(worker_id))
    return [{"channel": e.channel, "type": e.type, "data": _decode(e.data)} for e in rows]


def _decode(stored):
    # send_event JSON-encodes the payload, then DjangoModelStorage JSON-encodes that string again.
    data = json.loads(stored)
    return json.loads(data) if isinstance(data, str) else data


def audit_rows(action=None, *, accounts=False, **filters):
    """Return audit rows (oldest first), optionally only those of ``action``.

    Without ``action``, the rows of account changes and sign-ins (``user.*``, ``group.*``, ``auth.login``:
    what a test's users, their permissions and sessions write as it sets them up) only with ``accounts=True``.
    """
    rows = AuditEvent.objects.filter(**filters).order_by("id")
    if action is not None:
        rows = rows.filter(action=action)
    elif not accounts:
        rows = rows.exclude(action__startswith="user.").exclude(action__startswith="group.").exclude(action="auth.login")
    return list(rows)


def clear_failed_auth_counters():
    """Forget every failed authentication counted (in the cache, shared or not, and the process's fallback)."""
    from django.core.cache import caches
    from django.core.cache.backends.locmem import LocMemCache

    from workers import throttling

    throttling._fallback.clear()
    throttling._shared_down_until = 0.0
    cache = caches["default"]
    if isinstance(cache, LocMemCache):
        cache.clear()
    else:  # Redis, shared with the test's other users: only our keys
        client = cache._cache.get_client(None, write=True)
        for key in client.scan_iter(match="*:failed-auth:*"):
            client.delete(key)


@pytest.fixture(autouse=True)
def failed_auth_counters():
    """Each test starts with no failed authentication counted: the counters outlive a test's rollback."""
    clear_failed_auth_counters()


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
        client.credentials(**HttpHeaders.to_wsgi_names({protocol.WORKER_TOKEN_HEADER: token or worker_token(worker)}))
        return client

    return _make


# Every permission an operator action on workers needs (workers.permissions).
WORKER_MANAGER_PERMISSIONS = (
    "workers.view_worker",
    "workers.add_worker",
    "workers.drain_worker",
    "workers.rotate_worker_token",
    "workers.delete_worker",
)


@pytest.fixture
def operator():
    """A member of the shipped ``admin`` group (not a superuser): manages workers and jobs, reads the audit log."""
    return UserFactory(groups=["admin"])


@pytest.fixture
def operator_client(bearer_client, operator):
    return bearer_client(operator)


@pytest.fixture
def user_client(bearer_client):
    """An authenticated user without any permission: every operator endpoint refuses it (403)."""
    return bearer_client(UserFactory())


@pytest.fixture
def queue_client(bearer_client):
    """A member of the shipped ``operator`` group: may read, submit, cancel and retry jobs."""
    return bearer_client(UserFactory(groups=["operator"]))


# --- the Django admin, through the test client ----------------------------------------------------


@pytest.fixture
def staff_client(client):
    """``staff_client(*permissions)``: the test client signed in to the admin as a staff user with only those."""

    def _make(*permissions):
        client.force_login(UserFactory(is_staff=True, permissions=permissions))
        return client

    return _make


def admin_url(obj, view="change"):
    """Return the admin URL of ``obj``'s ``view`` page (change, delete, drain, cancel...), its id escaped as the admin does."""
    opts = obj._meta
    return reverse(f"admin:{opts.app_label}_{opts.model_name}_{view}", args=[quote(obj.pk)])


def admin_messages(response):
    """Return the texts of the admin messages ``response`` set (or, after ``follow=True``, displayed)."""
    if response.context is not None and "messages" in response.context:
        return [str(m) for m in response.context["messages"]]
    return [str(m) for m in get_messages(response.wsgi_request)]


def post_action(client, changelist_url, action, objects, **extra):
    """POST the admin list action ``action`` on ``objects``, as the list page's action bar does."""
    return client.post(changelist_url, {"action": action, "_selected_action": [o.pk for o in objects], **extra})


def listed(response):
    """Return the objects a changelist response shows, in order."""
    return list(response.context["cl"].result_list)


def changelist_rows(response):
    """Return ``{obj: row_html}`` for the rows a changelist response shows."""
    rows = [
        row.split("</tr>")[0]
        for row in response.content.decode().split("<tr>")[1:]
        if re.match(r'(<td class="action-checkbox">.*?</td>)?<th class="field-', row)
    ]
    objects = listed(response)
    assert len(rows) == len(objects), "a changelist row was not recognised"
    return dict(zip(objects, rows))


def action_names(response):
    """Return the list actions a changelist response offers."""
    form = response.context["action_form"]
    return set() if form is None else {name for name, _ in form.fields["action"].choices if name}


@pytest.fixture
def admin_user(db):
    """pytest-django's superuser "admin" (behind ``admin_client``), without a password: hashing one costs a second."""
    return UserFactory(username="admin", is_staff=True, is_superuser=True)
