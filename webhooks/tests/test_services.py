"""Webhooks' own writes: what a webhook may be (URL, its addresses, events, secret), and the audit trail's record."""

import socket

import pytest

from audit import actions
from audit.services import Actor
from common.errors import ServiceError
from workers.tests.support import audit_rows

from .. import services
from ..addresses import address_problem
from ..models import Webhook

SYSTEM = Actor.system("test")


def refusal(call):
    with pytest.raises(ServiceError) as caught:
        call()
    assert caught.value.status_code == 400
    return caught.value.extra["errors"]


@pytest.mark.parametrize(
    "address",
    ["127.0.0.1", "10.1.2.3", "172.16.0.9", "192.168.1.1", "169.254.169.254", "224.0.0.1", "0.0.0.0", "100.64.0.1",
     "::1", "fe80::1", "fc00::1", "::ffff:10.0.0.1", "240.0.0.1"],
)  # fmt: skip
def test_non_public_addresses_are_refused_by_default(address):
    assert address_problem(address)


@pytest.mark.parametrize("address", ["93.184.215.14", "2606:4700::1111", "8.8.8.8"])
def test_public_addresses_are_taken(address):
    assert address_problem(address) is None


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("ftp://hooks.example.com/", "http:// or https://"),
        ("https:///path", "no host"),
        ("https://user:pw@hooks.example.com/", "credentials"),
        ("http://127.0.0.1:8080/hook", "loopback"),
        ("http://internal.example.com/", "private"),  # resolves to 10.0.0.5 (below)
        ("http://[fe80::1]/", "link-local"),
        ("https://gone.example.com/", "does not resolve"),
        ("https://hooks.example.com:99999/", "not a valid URL"),
    ],
)
def test_a_refused_url_is_a_400_naming_the_url_and_makes_nothing(resolver, url, words):
    resolver["internal.example.com"] = ["93.184.215.14", "10.0.0.5"]  # one private address is enough
    resolver["gone.example.com"] = socket.gaierror("Name or service not known")

    errors = refusal(lambda: services.webhook_create(url=url, events=["job.completed"], secret="x" * 20, actor=SYSTEM))

    assert list(errors) == ["url"] and words in errors["url"][0], errors
    assert not Webhook.objects.exists()


@pytest.mark.django_db
def test_private_addresses_are_allowed_by_the_setting(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "WEBHOOK_ALLOW_PRIVATE": True}

    hook = services.webhook_create(url="http://127.0.0.1:9/hook", events=["job.completed"], secret="x" * 20, actor=SYSTEM)

    assert hook.url == "http://127.0.0.1:9/hook"


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"events": []}, "events"),
        ({"events": ["job.started"]}, "events"),
        ({"events": ["job.failed", "job.failed"]}, "events"),
        ({"secret": "short"}, "secret"),
        ({"secret": None}, "secret"),  # required for the signed JSON format
    ],
)
def test_bad_events_or_secret_are_a_400_naming_the_field(fields, field):
    given = {"url": "https://hooks.example.com/", "events": ["job.completed"], "secret": "x" * 20, **fields}

    errors = refusal(lambda: services.webhook_create(actor=SYSTEM, **given))

    assert list(errors) == [field]
    assert not Webhook.objects.exists()


@pytest.mark.django_db
def test_a_slack_webhook_needs_no_secret():
    hook = services.webhook_create(url="https://hooks.slack.com/services/T/B/X", events=["job.failed"], format="slack", actor=SYSTEM)

    assert hook.format == "slack" and len(hook.secret) >= 16


@pytest.mark.django_db
def test_the_audit_trail_records_changes_without_the_secret_or_the_url_path():
    hook = services.webhook_create(
        url="https://hooks.slack.com/services/T0/B0/KEY", events=["job.failed"], secret="the-secret-value-1", actor=SYSTEM
    )
    services.webhook_update(webhook_id=hook.pk, secret="the-secret-value-2", active=False, actor=SYSTEM)
    services.webhook_delete(webhook_id=hook.pk, actor=SYSTEM)

    rows = audit_rows()
    assert [r.action for r in rows] == [actions.WEBHOOK_CREATED, actions.WEBHOOK_UPDATED, actions.WEBHOOK_DELETED]
    assert rows[1].details["changed"] == ["active", "secret"]
    text = repr([r.details for r in rows])
    assert "the-secret-value" not in text and "KEY" not in text and "hooks.slack.com" in text
    assert not Webhook.objects.exists()


@pytest.mark.django_db
def test_an_update_of_a_missing_webhook_is_a_404():
    with pytest.raises(ServiceError) as caught:
        services.webhook_update(webhook_id="wh_missing", active=False, actor=SYSTEM)
    assert caught.value.status_code == 404


@pytest.mark.django_db
def test_an_update_that_changes_nothing_writes_nothing():
    hook = services.webhook_create(url="https://hooks.example.com/", events=["job.failed"], secret="x" * 20, actor=SYSTEM)
    before = list(Webhook.objects.values())

    services.webhook_update(webhook_id=hook.pk, events=["job.failed"], actor=SYSTEM)
    services.webhook_update(webhook_id=hook.pk, actor=SYSTEM)

    assert list(Webhook.objects.values()) == before
    assert [r.action for r in audit_rows()] == [actions.WEBHOOK_CREATED]
