"""The operators' change feed ends once its session would no longer open it: pushed on the account change, and
re-checked periodically for what a push missed. Real streams through the site's ASGI application."""

import asyncio
import time

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from asgiref.testing import ApplicationCommunicator
from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.contrib.sessions.models import Session
from django.test import Client
from django_eventstream import views as es_views
from django_eventstream.utils import sse_encode_error

from realtime import operator_feed
from simpletuner_site.asgi import application
from simpletuner_site.tests.asgi_support import rest_of_body
from workers.tests.factories import UserFactory

pytestmark = pytest.mark.django_db(transaction=True)  # the feed reads sessions and users on connections of its own

PAD = b":" + b" " * 2048 + b"\n\n"
OPEN = PAD + b"event: stream-open\ndata:\n\n"
ENDED = sse_encode_error("forbidden", operator_feed.REVOKED).encode()  # the feed's last words, then it ends


@pytest.fixture(autouse=True)
def fast_hasher(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


def signed_in(user):
    """Return ``(test client, session key)`` of a new admin session of ``user``."""
    client = Client()
    client.force_login(user)
    return client, client.session.session_key


def feed_scope(session_key):
    path = operator_feed.OPERATOR_FEED_PATH
    cookie = f"{settings.SESSION_COOKIE_NAME}={session_key}".encode()
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": [(b"host", b"testserver"), (b"cookie", cookie)], "client": ("127.0.0.1", 1234),
            "server": ("testserver", 80)}  # fmt: skip


async def open_feed(session_key):
    """Open a feed with the session; return its communicator once the stream is open and this process hears Redis."""
    comm = ApplicationCommunicator(application, feed_scope(session_key))
    await comm.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await comm.receive_output(10)
    assert start["status"] == 200
    assert (await comm.receive_output(10))["body"] == OPEN
    redis = es_views.get_listener_manager().redis_listener
    deadline = time.monotonic() + 10
    while redis is not None and not redis.subscribed:  # a control message published before would miss us
        assert time.monotonic() < deadline, "the Redis event listener did not subscribe"
        await asyncio.sleep(0.01)
    return comm


async def still_open(comm):
    """Assert the feed ``comm`` is open: a change announced now reaches it within 10 s.

    Announced again each second: the feed is unstored, and an event that lands while a stream re-reads
    (its catch-up when the Redis listener subscribes) is dropped, as the feed's hints may be.
    """
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        await sync_to_async(operator_feed.on_changes)(targets={("worker", "w_still_open")})
        while not await comm.receive_nothing(timeout=1):  # a message is waiting
            message = await comm.receive_output(1)
            assert message["more_body"], "the feed ended"
            if b'"id": "w_still_open"' in message["body"]:
                return
    raise AssertionError("the feed heard no change within 10 s")


async def ended(comm):
    """Return the last event of feed ``comm`` once it ends (each part within 10 s). Change hints may come before it:
    with Redis they are published in the background, and an earlier test's may still be on their way."""
    text = (await rest_of_body(comm)).rstrip(b"\n").rsplit(b"\n\n", 1)[-1] + b"\n\n"
    await comm.wait(10)
    return text


async def hang_up(comm):
    await comm.send_input({"type": "http.disconnect"})
    await comm.wait(10)


def ended_while_the_other_stays(session, other_session, change):
    """Open a feed with each session, run ``change()``; return the first feed's last words once it ended, having
    checked that the other feed still hears changes."""

    async def run():
        comm, other = await open_feed(session), await open_feed(other_session)
        await sync_to_async(change)()
        text = await ended(comm)
        await still_open(other)
        await hang_up(other)
        return text

    return async_to_sync(run)()


def _deactivate(user, client):
    user.is_active = False
    user.save()


def _not_staff(user, client):
    user.is_staff = False
    user.save()


def _permission_removed(user, client):
    user.user_permissions.remove(Permission.objects.get(content_type__app_label="workers", codename="view_worker"))


def _signed_out(user, client):
    assert client.post("/admin/logout/").status_code == 200


def _new_password(user, client):
    user.set_password("a-brand-new-secret")
    user.save()


def _deleted(user, client):
    user.delete()


@pytest.mark.parametrize(
    "change",
    [_deactivate, _not_staff, _permission_removed, _signed_out, _new_password, _deleted],
    ids=["deactivated", "no-longer-staff", "permission-removed", "signed-out", "new-password", "deleted"],
)
def test_an_open_feed_ends_when_its_user_loses_access_and_another_users_stays(change):
    user = UserFactory(is_staff=True, permissions=["workers.view_worker"])
    client, session = signed_in(user)
    _, other_session = signed_in(UserFactory(is_staff=True, permissions=["workers.view_worker"]))

    assert ended_while_the_other_stays(session, other_session, lambda: change(user, client)) == ENDED
    # and it cannot be opened again
    status = async_to_sync(_status)(session)
    assert status in (401, 403)


async def _status(session_key):
    comm = ApplicationCommunicator(application, feed_scope(session_key))
    await comm.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await comm.receive_output(10)
    await rest_of_body(comm)
    return start["status"]


def test_a_feed_whose_user_keeps_a_permission_to_follow_stays_open():
    user = UserFactory(is_staff=True, permissions=["workers.view_worker", "queue.view_job"])
    _, session = signed_in(user)

    async def run():
        comm = await open_feed(session)
        await sync_to_async(_permission_removed)(user, None)
        await still_open(comm)  # re-checked and kept: view_job still lets it follow
        await hang_up(comm)

    async_to_sync(run)()


def test_signing_out_one_session_ends_that_sessions_feed_only():
    user = UserFactory(is_staff=True, permissions=["workers.view_worker"])
    client, session = signed_in(user)
    _, second_session = signed_in(user)

    assert ended_while_the_other_stays(session, second_session, lambda: _signed_out(user, client)) == ENDED


@pytest.mark.parametrize("bypass", ["queryset-update", "session-expired"])
def test_the_periodic_re_check_ends_a_feed_no_push_announced(monkeypatch, bypass):
    monkeypatch.setattr(operator_feed, "RECHECK_INTERVAL_S", 0.2)
    user = UserFactory(is_staff=True, permissions=["workers.view_worker"])
    _, session = signed_in(user)

    def bypassing_the_signals():
        if bypass == "queryset-update":
            get_user_model().objects.filter(pk=user.pk).update(is_active=False)
        else:
            Session.objects.filter(pk=session).update(expire_date="2000-01-01T00:00:00Z")

    async def run():
        comm = await open_feed(session)
        await sync_to_async(bypassing_the_signals)()
        return await ended(comm)

    assert async_to_sync(run)() == ENDED


def test_a_feed_left_unfollowable_while_redis_was_down_ends_when_the_listener_resubscribes(monkeypatch):
    monkeypatch.setattr(operator_feed, "RECHECK_INTERVAL_S", 3600)  # not the periodic re-check: the resubscription's
    user = UserFactory(is_staff=True, permissions=["workers.view_worker"])
    _, session = signed_in(user)

    async def run():
        comm = await open_feed(session)
        await sync_to_async(get_user_model().objects.filter(pk=user.pk).update)(is_active=False)
        await es_views.get_listener_manager().resync(recheck_tokens=True)  # what the Redis listener does
        return await ended(comm)

    assert async_to_sync(run)() == ENDED
