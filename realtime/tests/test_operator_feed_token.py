"""The operators' change feed opened with an API token (`simpletuner jobs watch`): a user who may view jobs follows
it without being staff; a refused token is a 401 (counted), no permission a 403; a revoked token ends an open feed."""

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from asgiref.testing import ApplicationCommunicator
from django.utils import timezone

from realtime import operator_feed
from realtime.tests.test_operator_feed_access import ENDED, OPEN, ended, hang_up, still_open
from simpletuner_site.asgi import application
from simpletuner_site.tests.asgi_support import asgi_exchange
from workers.models import Token
from workers.tests.factories import UserFactory, api_token
from workers.tests.support import audit_rows, clear_failed_auth_counters

pytestmark = pytest.mark.django_db(transaction=True)


def token_scope(authorization):
    path = operator_feed.OPERATOR_FEED_PATH
    headers = [(b"host", b"testserver")] + ([(b"authorization", authorization.encode())] if authorization else [])
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "headers": headers, "client": ("127.0.0.1", 1234), "server": ("testserver", 80)}  # fmt: skip


async def open_with(token):
    comm = ApplicationCommunicator(application, token_scope(f"Bearer {token}"))
    await comm.send_input({"type": "http.request", "body": b"", "more_body": False})
    start = await comm.receive_output(10)
    assert start["status"] == 200
    assert (await comm.receive_output(10))["body"] == OPEN
    return comm


def refused(authorization):
    start, body = async_to_sync(asgi_exchange)(application, token_scope(authorization))
    return start["status"], body


def test_a_user_who_may_view_jobs_follows_the_feed_with_a_token_without_being_staff():
    token = api_token(UserFactory(is_staff=False, permissions=["queue.view_job"]))

    async def run():
        comm = await open_with(token)
        await still_open(comm)
        await hang_up(comm)

    async_to_sync(run)()


def test_a_refused_token_is_a_counted_401_and_no_permission_a_403():
    status, body = refused("Bearer sta_not-a-token")
    assert status == 401 and b'"not_authenticated"' in body
    assert audit_rows("auth.failed")  # counted and audited as on every endpoint
    assert refused("Basic dXNlcjpwYXNz")[0] == 401
    assert refused(None)[0] == 401
    status, body = refused(f"Bearer {api_token(UserFactory(is_staff=True))}")
    assert status == 403 and b'"permission_denied"' in body


def test_past_the_failure_rate_a_refused_token_is_a_429_with_retry_after(settings):
    settings.REST_FRAMEWORK = {**settings.REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": {"failed_auth": "2/min"}}
    clear_failed_auth_counters()
    answers = [async_to_sync(asgi_exchange)(application, token_scope("Bearer sta_nope"))[0] for _ in range(3)]
    assert [start["status"] for start in answers] == [401, 401, 429]
    headers = {name.lower(): value for name, value in answers[-1]["headers"]}
    assert int(headers[b"retry-after"]) > 0
    clear_failed_auth_counters()


@pytest.mark.parametrize("ending", ["revoked_at", "expires_at"])
def test_revoking_the_token_or_its_expiry_ends_its_open_feed(monkeypatch, ending):
    monkeypatch.setattr(operator_feed, "RECHECK_INTERVAL_S", 0.2)
    user = UserFactory(permissions=["queue.view_job"])
    token, other = api_token(user), api_token(user)
    first = Token.objects.filter(user=user).order_by("pk").first()

    async def run():
        comm, stays = await open_with(token), await open_with(other)
        await sync_to_async(Token.objects.filter(pk=first.pk).update)(**{ending: timezone.now()})
        text = await ended(comm)
        await still_open(stays)  # the same user's other token keeps its feed
        await hang_up(stays)
        return text

    assert async_to_sync(run)() == ENDED
