"""The Webhooks admin pages: add and change through the service (the secret write-only), deliveries with their
attempts, redelivery after a confirmation."""

import pytest
from django.urls import reverse

from audit.services import Actor
from job_queue.services import job_cancel
from job_queue.tests.factories import JobFactory
from workers.tests.support import admin_url

from .. import sender
from ..client import Answer
from ..models import Delivery, Webhook

pytestmark = pytest.mark.django_db
VIEW, ADD, CHANGE, REDELIVER = "webhooks.view_webhook", "webhooks.add_webhook", "webhooks.change_webhook", "webhooks.redeliver_webhook"


def test_add_a_webhook_from_the_form(staff_client):
    client = staff_client(VIEW, ADD)
    form = {"url": "https://hooks.example.com/a", "events": ["job.failed", "worker.offline"], "secret": "form-secret-0123456", "format": "json", "active": "on"}

    response = client.post(reverse("admin:webhooks_webhook_add"), form)

    assert response.status_code == 302, response.content.decode()[:2000]
    hook = Webhook.objects.get()
    assert (hook.url, hook.events, hook.secret) == ("https://hooks.example.com/a", ["job.failed", "worker.offline"], "form-secret-0123456")


def test_a_refused_url_is_a_form_error_and_makes_nothing(staff_client):
    client = staff_client(VIEW, ADD)
    form = {"url": "http://10.0.0.8/hook", "events": ["job.failed"], "secret": "form-secret-0123456", "format": "json"}

    response = client.post(reverse("admin:webhooks_webhook_add"), form)

    assert response.status_code == 200 and "private" in response.content.decode()
    assert not Webhook.objects.exists()


def test_the_change_page_never_shows_the_secret_and_an_empty_one_keeps_it(staff_client, make_webhook):
    hook = make_webhook(secret="never-shown-secret-42")
    client = staff_client(VIEW, CHANGE)

    page = client.get(admin_url(hook))
    assert page.status_code == 200 and "never-shown-secret-42" not in page.content.decode()
    form = {"url": hook.url, "events": ["job.completed"], "secret": "", "format": "json", "active": "on"}
    assert client.post(admin_url(hook), form).status_code == 302
    hook.refresh_from_db()
    assert (hook.events, hook.secret) == (["job.completed"], "never-shown-secret-42")


def test_a_viewer_of_webhooks_cannot_change_one(staff_client, make_webhook):
    hook = make_webhook()
    client = staff_client(VIEW)

    client.post(admin_url(hook), {"url": "https://hooks.example.com/other", "events": ["job.failed"], "secret": "", "format": "json"})

    assert Webhook.objects.get().url == hook.url


def test_a_delivery_page_shows_its_attempts_and_redelivers_after_a_confirmation(staff_client, make_webhook):
    make_webhook(events=["job.cancelled"])
    job_cancel(job_id=JobFactory().pk, actor=Actor.system("test"))
    sender.deliver_due(post=lambda url, body, headers: Answer(status_code=404))
    delivery = Delivery.objects.get()
    client = staff_client(VIEW, REDELIVER)

    page = client.get(admin_url(delivery)).content.decode()
    assert delivery.delivery_id in page and "404" in page and 'id="redeliver"' in page
    asked = client.post(admin_url(delivery, "redeliver"))
    assert asked.status_code == 200 and "Yes, redeliver" in asked.content.decode()
    assert Delivery.objects.get().status == "failed"
    done = client.post(admin_url(delivery, "redeliver"), {"post": "yes"})
    assert done.status_code == 302
    assert Delivery.objects.get().status == "pending"


def test_without_the_redeliver_permission_there_is_no_button_and_the_post_is_refused(staff_client, make_webhook):
    make_webhook(events=["job.cancelled"])
    job_cancel(job_id=JobFactory().pk, actor=Actor.system("test"))
    sender.deliver_due(post=lambda url, body, headers: Answer(status_code=404))
    delivery = Delivery.objects.get()
    client = staff_client(VIEW)

    assert 'id="redeliver"' not in client.get(admin_url(delivery)).content.decode()
    assert client.post(admin_url(delivery, "redeliver"), {"post": "yes"}).status_code == 403
    assert Delivery.objects.get().status == "failed"
