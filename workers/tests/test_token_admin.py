"""The Tokens page: an operator creates an API token (shown once, with an expiry) and revokes one,
after a confirmation (issue 14.5); an expired token is refused like a revoked one."""

import re
from datetime import timedelta

import pytest
from django.utils import timezone

from audit import actions
from audit.services import Actor
from workers.models import Token, TokenKind
from workers.services import api_token_create, token_authenticate
from workers.tests.factories import UserFactory, api_token
from workers.tests.support import admin_messages, audit_rows, post_action

pytestmark = pytest.mark.django_db

TOKENS = "/admin/workers/token/"
ADD = TOKENS + "add/"


def shown(response):
    return re.search(r'id="api-token">([^<]*)</div>', response.content.decode()).group(1)


def test_an_operator_creates_their_own_token_shown_once_with_its_expiry(client, commit):
    operator = UserFactory(is_staff=True, permissions=["workers.view_token", "workers.manage_api_tokens"])
    other = UserFactory(username="someone-else")
    client.force_login(operator)

    form = client.get(ADD).content.decode()
    assert 'id="api_token_form"' in form and "someone-else" not in form  # only their own account
    assert client.post(ADD, {"user": other.pk, "expires": "7"}).status_code == 200  # refused: not a choice
    assert not Token.objects.filter(user=other).exists()

    with commit():
        response = client.post(ADD, {"user": operator.pk, "description": "CI", "expires": "7"})

    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    plaintext = shown(response)
    token = token_authenticate(kind=TokenKind.API, plaintext=plaintext)
    assert (token.user_id, token.description) == (operator.pk, "CI")
    assert timedelta(days=6, hours=23) < token.expires_at - timezone.now() <= timedelta(days=7)
    (row,) = audit_rows(actions.API_TOKEN_CREATED)
    assert row.details["expires_at"] == token.expires_at.isoformat()
    assert plaintext not in client.get(TOKENS).content.decode()


def test_a_custom_expiry_date_in_the_past_is_refused_and_never_works(admin_client, admin_user):
    past = (timezone.localtime() - timedelta(days=1)).strftime("%Y-%m-%d %H:%M")
    response = admin_client.post(ADD, {"user": admin_user.pk, "expires": "date", "expires_on": past})
    assert response.status_code == 200 and "the expiry must be in the future" in response.content.decode()
    missing = admin_client.post(ADD, {"user": admin_user.pk, "expires": "date"})
    assert "Give the date" in missing.content.decode()
    assert not Token.objects.filter(kind=TokenKind.API).exists()


def test_an_expired_token_is_refused():
    user = UserFactory()
    plaintext = api_token_create(user=user, actor=Actor.system("test"), expires_at=timezone.now() + timedelta(seconds=60))
    assert token_authenticate(kind=TokenKind.API, plaintext=plaintext) is not None
    Token.objects.filter(user=user).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert token_authenticate(kind=TokenKind.API, plaintext=plaintext) is None


def test_an_expired_token_is_refused_by_the_api(client):
    user = UserFactory(is_superuser=True)
    plaintext = api_token(user)
    assert client.get("/api/queue/", HTTP_AUTHORIZATION=f"Bearer {plaintext}").status_code == 200
    Token.objects.filter(user=user).update(expires_at=timezone.now() - timedelta(seconds=1))
    refused = client.get("/api/queue/", HTTP_AUTHORIZATION=f"Bearer {plaintext}")
    assert (refused.status_code, refused.json()["code"]) == (401, "not_authenticated")


def test_revoking_asks_first_listing_the_tokens(admin_client, commit):
    user = UserFactory(username="ci-bot")
    api_token(user)
    token = Token.objects.get(user=user)

    asked = post_action(admin_client, TOKENS, "revoke_api_tokens", [token])
    assert asked.status_code == 200 and f"{token.prefix}… (ci-bot)" in asked.content.decode()
    assert Token.objects.get(pk=token.pk).revoked_at is None

    with commit():
        done = post_action(admin_client, TOKENS, "revoke_api_tokens", [token], post="yes")
    assert admin_messages(done) == [f"Revoked 1 API token(s): {token.prefix}"]
    assert Token.objects.get(pk=token.pk).revoked_at is not None


def test_manage_py_create_api_token_with_an_expiry():
    from io import StringIO

    from django.core.management import call_command

    user = UserFactory(username="ops-bot")
    out = StringIO()
    call_command("create_api_token", "ops-bot", "--expires-in", "2", stdout=out, stderr=StringIO())
    token = token_authenticate(kind=TokenKind.API, plaintext=out.getvalue().strip().splitlines()[-1])
    assert token.user_id == user.pk
    assert timedelta(days=1, hours=23) < token.expires_at - timezone.now() <= timedelta(days=2)
