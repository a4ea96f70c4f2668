"""The webhooks API: create (201), list, show, change, delete; deliveries and redelivery; the secret never shown."""

import pytest

from audit.services import Actor
from job_queue.services import job_cancel
from job_queue.tests.factories import JobFactory
from workers.tests.factories import UserFactory

from .. import sender
from ..client import Answer
from ..models import Delivery, Webhook

pytestmark = pytest.mark.django_db
BODY = {"url": "https://hooks.example.com/st", "events": ["job.completed", "worker.offline"], "secret": "0123456789abcdef-secret"}


@pytest.fixture
def admin_group_client(bearer_client):
    """A member of the shipped ``admin`` group, which holds the webhook permissions."""
    return bearer_client(UserFactory(groups=["admin"]))


def test_create_list_show_change_delete(admin_group_client):
    created = admin_group_client.post("/api/admin/webhooks", BODY)
    assert created.status_code == 201, created.content
    hook = created.json()
    assert hook["events"] == ["job.completed", "worker.offline"] and hook["format"] == "json" and hook["active"] is True
    url = f"/api/admin/webhooks/{hook['id']}"

    assert [h["id"] for h in admin_group_client.get("/api/admin/webhooks").json()["results"]] == [hook["id"]]
    assert admin_group_client.get(url).json()["url"] == BODY["url"]
    changed = admin_group_client.patch(url, {"events": ["job.failed"], "active": False})
    assert changed.status_code == 200 and changed.json()["events"] == ["job.failed"] and changed.json()["active"] is False
    assert Webhook.objects.get().secret == BODY["secret"]  # a PATCH without it keeps it
    assert admin_group_client.delete(url).status_code == 204
    assert admin_group_client.get(url).status_code == 404


def test_the_secret_is_write_only(admin_group_client):
    hook = admin_group_client.post("/api/admin/webhooks", BODY).json()
    patched = admin_group_client.patch(f"/api/admin/webhooks/{hook['id']}", {"secret": "another-secret-value-0"})

    for response in (admin_group_client.get("/api/admin/webhooks"), admin_group_client.get(f"/api/admin/webhooks/{hook['id']}"), patched):
        assert "secret" not in response.content.decode()
    assert Webhook.objects.get().secret == "another-secret-value-0"


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"url": "http://127.0.0.1/x"}, "url"),
        ({"url": "gopher://hooks.example.com"}, "url"),
        ({"events": ["job.exploded"]}, "events"),
        ({"events": []}, "events"),
        ({"secret": "short"}, "secret"),
        ({"format": "xml"}, "format"),
        ({"active": "yes"}, "active"),
        ({"labels": {}}, "labels"),  # unknown
    ],
)
def test_bad_input_is_a_400_naming_the_field_and_changes_nothing(admin_group_client, change, field):
    refused = admin_group_client.post("/api/admin/webhooks", {**BODY, **change})
    assert refused.status_code == 400 and field in refused.json()["errors"], refused.content
    assert not Webhook.objects.exists()

    hook = admin_group_client.post("/api/admin/webhooks", BODY).json()
    before = list(Webhook.objects.values())
    refused = admin_group_client.patch(f"/api/admin/webhooks/{hook['id']}", change)
    assert refused.status_code == 400 and field in refused.json()["errors"], refused.content
    assert list(Webhook.objects.values()) == before


@pytest.mark.parametrize("group", ["viewer", "operator"])
def test_webhooks_are_admin_configuration_viewers_and_operators_are_refused(bearer_client, group):
    caller = bearer_client(UserFactory(groups=[group]))

    assert caller.get("/api/admin/webhooks").status_code == 403
    assert caller.post("/api/admin/webhooks", BODY).status_code == 403
    assert not Webhook.objects.exists()


def test_deliveries_with_their_attempts_and_redelivery(admin_group_client, monkeypatch):
    hook = admin_group_client.post("/api/admin/webhooks", {**BODY, "events": ["job.cancelled"]}).json()
    job_cancel(job_id=JobFactory().pk, actor=Actor.system("test"))
    sender.deliver_due(post=lambda url, body, headers: Answer(status_code=410))
    deliveries = admin_group_client.get(f"/api/admin/webhooks/{hook['id']}/deliveries").json()["results"]
    ((delivery),) = deliveries
    assert (delivery["status"], delivery["last_status_code"], delivery["event"]) == ("failed", 410, "job.cancelled")
    assert [a["status_code"] for a in delivery["attempt_history"]] == [410]

    again = admin_group_client.post(f"/api/admin/webhooks/{hook['id']}/deliveries/{delivery['id']}/redeliver")
    assert again.status_code == 202 and again.json()["status"] == "pending"
    assert admin_group_client.post(f"/api/admin/webhooks/{hook['id']}/deliveries/{delivery['id']}/redeliver").status_code == 409
    assert admin_group_client.post(f"/api/admin/webhooks/{hook['id']}/deliveries/whd_nope/redeliver").status_code == 404
    assert Delivery.objects.get().status == "pending"
