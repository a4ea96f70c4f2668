"""Fixtures of the webhooks tests: a resolver that needs no network, webhooks, and a sender run by hand."""

import pytest

from audit.services import Actor

from .. import addresses, services
from ..sender import SENDER

PUBLIC = "93.184.215.14"  # what every test host resolves to unless a test says otherwise


@pytest.fixture(autouse=True)
def resolver(monkeypatch):
    """``resolver["host"] = ["10.0.0.1"]``: what a host resolves to in this test (a literal address: itself)."""
    table = {}

    def resolve(host, port):
        if host in table:
            value = table[host]
            if isinstance(value, Exception):
                raise value
            return list(value)
        try:
            addresses.ipaddress.ip_address(host)
            return [host]
        except ValueError:
            return [PUBLIC]

    monkeypatch.setattr(addresses, "resolve", resolve)
    return table


@pytest.fixture(autouse=True)
def no_sender_thread(monkeypatch):
    """No test runs the sender's thread: a test sends with ``deliver_due`` when it means to."""
    monkeypatch.setattr(SENDER, "enabled", False)


@pytest.fixture
def make_webhook(db):
    """``make_webhook(events=[...], url=..., **fields)``: a webhook created through the service."""

    def _make(events=("job.completed", "job.failed", "job.cancelled", "job.requeued", "worker.offline"), **fields):
        fields.setdefault("url", "https://hooks.example.com/simpletuner")
        fields.setdefault("secret", "s3cret-s3cret-s3cret")
        return services.webhook_create(events=list(events), actor=Actor.system("test"), **fields)

    return _make
