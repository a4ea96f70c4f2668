"""The Webhooks admin pages in real Chromium: add a webhook (its secret never shown back), follow a delivery and its
attempts, redeliver it after a confirmation. Screenshots in test-artifacts/browser/webhooks-*.png."""

import re
import secrets

import pytest

from tests.e2e.harness import Orchestrator, expect as expect_status, poll
from tests.e2e.test_webhooks import Receiver

from .test_pages_fit import OVERFLOWING, WIDTH
from .support import ADMIN_PASSWORD, ADMIN_USERNAME, VIEWPORT, expect, screenshot, set_password, submit_login_form

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

SECRET = "browser-secret-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def hooked_orchestrator(tmp_path_factory):
    """An orchestrator of this module's own that may call a receiver on loopback."""
    server = Orchestrator(
        backend="sqlite", data_dir=tmp_path_factory.mktemp("orchestrator-webhooks"), extra_env={"SIMPLETUNER_WEBHOOK_ALLOW_PRIVATE": "true"}
    ).start()
    try:
        set_password(server, ADMIN_USERNAME, ADMIN_PASSWORD)
        yield server
    finally:
        server.stop()


@pytest.fixture
def admin_page(browser, hooked_orchestrator):
    context = browser.new_context(base_url=hooked_orchestrator.base_url, viewport=VIEWPORT)
    page = context.new_page()
    try:
        submit_login_form(page, ADMIN_USERNAME, ADMIN_PASSWORD)
        page.wait_for_url(re.compile(r"/admin/$"))
        yield page
    finally:
        context.close()


def test_add_a_webhook_follow_its_delivery_and_redeliver_it(admin_page, hooked_orchestrator):
    page, server = admin_page, hooked_orchestrator
    receiver = Receiver(secret=SECRET).start()
    receiver.plan = {"/hook": [410]}
    try:
        page.goto("/admin/webhooks/webhook/add/")
        page.locator("#id_url").fill(receiver.url("/hook"))
        page.get_by_label("job.cancelled").check()
        page.get_by_label("job.failed").check()
        page.locator("#id_secret").fill(SECRET)
        screenshot(page, "webhooks-add")
        page.locator("input[name=_save]").click()
        expect(page.locator("#result_list")).to_contain_text(receiver.url("/hook"))
        assert page.viewport_size["width"] == WIDTH and page.evaluate(OVERFLOWING) == []
        screenshot(page, "webhooks-list")
        page.locator("#result_list tbody th a").first.click()
        expect(page.locator("#id_url")).to_have_value(receiver.url("/hook"))
        assert SECRET not in page.content()

        body = {"config_name": "browser-webhook", "worker_labels": {"pool": "nobody"}}
        job_id = expect_status(server.admin("POST", "/api/queue/submit", json=body), 201)["job_id"]
        expect_status(server.admin("POST", f"/api/queue/{job_id}/cancel", json={}), 200)
        poll(lambda: receiver.seen("/hook", id=job_id), timeout=10, message="the delivery")

        page.goto("/admin/webhooks/delivery/")
        row = page.locator("#result_list tbody tr").first
        expect(row).to_contain_text("job.cancelled")
        expect(row).to_contain_text("Failed")
        assert page.evaluate(OVERFLOWING) == []
        screenshot(page, "webhooks-deliveries")
        row.locator("th a").first.click()
        expect(page.locator(".inline-group")).to_contain_text("410")
        expect(page.locator(".field-body_display")).to_contain_text(job_id)
        screenshot(page, "webhooks-delivery-failed")

        change_url = page.url
        page.locator("#redeliver").click()
        expect(page.locator("#content")).to_contain_text("Send these deliveries again")
        screenshot(page, "webhooks-redeliver-confirm")
        page.locator("#confirm-yes").click()
        expect(page.locator(".messagelist")).to_contain_text("Redelivering")
        poll(lambda: len(receiver.seen("/hook", id=job_id)) == 2, timeout=10, message="the redelivery")
        page.goto(change_url)
        expect(page.locator(".field-status_display")).to_contain_text("Delivered")
        first, second = receiver.seen("/hook", id=job_id)
        assert first["headers"]["X-SimpleTuner-Delivery"] == second["headers"]["X-SimpleTuner-Delivery"]
        assert first["signed"] and second["signed"]
        screenshot(page, "webhooks-delivery-redelivered")
    finally:
        receiver.stop()
