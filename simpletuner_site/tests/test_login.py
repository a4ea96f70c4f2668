"""The sign-in pages (admin and browsable API): failed sign-ins throttled per address and per username before
the password is hashed, and audited in bounded form; successful sign-ins audited."""

import pytest
from django.contrib.auth import SESSION_KEY
from django.contrib.auth.hashers import MD5PasswordHasher

from audit import actions
from audit.models import AuditEvent
from workers import throttling
from workers.tests.factories import UserFactory
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

PASSWORD = "correct horse battery staple"
WRONG = "Tr0ub4dor&3-never-recorded"
RATE = 10  # the shipped SIMPLETUNER_FAILED_LOGIN_RATE: 10/min
PAGES = ["/admin/login/", "/api-auth/login/"]


@pytest.fixture(autouse=True)
def hashing(settings, monkeypatch):
    """A fast hasher, and a list that grows by one each time a password is hashed (checked or made)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    runs = []
    original = MD5PasswordHasher.encode

    def counted(self, *args, **kwargs):  # checking a password encodes it once too
        runs.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MD5PasswordHasher, "encode", counted)
    return runs


@pytest.fixture
def clock(monkeypatch):
    """The throttles' clock: 10 s into a minute; ``clock[0] += 60`` moves it on a window."""
    now = [1_699_999_990.0]
    monkeypatch.setattr(throttling.FailedAuthenticationThrottle, "timer", lambda self: now[0])
    return now


@pytest.fixture
def staff():
    user = UserFactory(username="ops", is_staff=True, is_superuser=True)
    user.set_password(PASSWORD)
    user.save()
    return user


def sign_in(client, page, username="ops", password=WRONG, address="203.0.113.9"):
    return client.post(page, {"username": username, "password": password, "next": "/admin/"}, REMOTE_ADDR=address)


def signed_in(client):
    return SESSION_KEY in client.session


@pytest.mark.parametrize("page", PAGES)
def test_forty_wrong_passwords_then_the_right_one_does_not_sign_in_within_the_window(client, staff, clock, hashing, page):
    hashing.clear()
    answers = [sign_in(client, page) for _ in range(40)]
    hashed = len(hashing)
    right = sign_in(client, page, password=PASSWORD)

    assert [a.status_code for a in answers] == [200] * RATE + [429] * (40 - RATE)
    assert right.status_code == 429
    assert right["Retry-After"] == "50"  # the rest of the minute
    assert "Too many failed sign-ins from this address or for this username: try again in 50 seconds." in right.text
    assert not signed_in(client)
    # Only the failures within the rate cost a hash: the 30 refused and the right password none.
    assert hashed == RATE
    assert len(hashing) == RATE

    clock[0] += 60
    assert sign_in(client, page, password=PASSWORD).status_code == 302
    assert signed_in(client)


def test_the_username_is_throttled_whatever_the_address(client, staff, clock):
    for n in range(RATE):
        assert sign_in(client, "/admin/login/", address=f"198.51.100.{n + 1}").status_code == 200

    assert sign_in(client, "/admin/login/", password=PASSWORD, address="192.0.2.200").status_code == 429
    assert not signed_in(client)
    # Another username from a fresh address is unaffected.
    assert sign_in(client, "/admin/login/", username="nobody", address="192.0.2.201").status_code == 200


def test_the_address_is_throttled_whatever_the_username(client, staff, clock, hashing):
    hashing.clear()
    for n in range(RATE):
        sign_in(client, "/api-auth/login/", username=f"guess{n}")

    refused = sign_in(client, "/admin/login/", password=PASSWORD)

    assert refused.status_code == 429
    assert not signed_in(client)
    assert len(hashing) == RATE  # unknown usernames are hashed too (Django's timing defence), never past the rate
    assert sign_in(client, "/admin/login/", password=PASSWORD, address="203.0.113.10").status_code == 302


def test_a_flood_of_failures_writes_bounded_rows_naming_the_username_never_the_password(client, staff, clock):
    for _ in range(100):
        sign_in(client, "/admin/login/")

    failed, by_address, by_username = audit_rows(success=False)
    assert (failed.action, by_address.action, by_username.action) == (actions.AUTH_LOGIN_FAILED,) + (
        actions.AUTH_LOGIN_THROTTLED,
    ) * 2
    assert {row.client_ip for row in (failed, by_address, by_username)} == {"203.0.113.9"}
    assert failed.details == {
        "username": "ops",
        "path": "/admin/login/",
        "window_seconds": 60,
        "failures_in_previous_window": 0,
    }
    assert by_address.details == {
        "username": "ops", "path": "/admin/login/", "per": "address", "failures": RATE, "window_seconds": 60,
        "retry_after": 50,
    }  # fmt: skip
    assert by_username.details["per"] == "username"
    assert not AuditEvent.objects.filter(details__icontains="Tr0ub4dor").exists()

    clock[0] += 60
    sign_in(client, "/admin/login/")
    newest = audit_rows(success=False)[-1]
    assert (newest.action, newest.details["failures_in_previous_window"]) == (actions.AUTH_LOGIN_FAILED, 100)


@pytest.mark.parametrize("page", PAGES)
def test_a_successful_sign_in_is_audited_with_its_address(client, staff, page):
    assert sign_in(client, page, password=PASSWORD, address="192.0.2.33").status_code == 302

    (row,) = audit_rows(action=actions.AUTH_LOGIN)
    assert (row.actor_type, row.actor_id, row.actor_name, row.client_ip) == ("user", str(staff.pk), "ops", "192.0.2.33")
    assert (row.target_type, row.target_id, row.details) == ("user", str(staff.pk), {"username": "ops", "path": page})
    assert audit_rows(success=False) == []
