"""Browser tests of the admin's login and of the read-only audit log."""

import re
import secrets

import pytest

from tests.e2e.harness import expect as expect_json

from .support import ADMIN_USERNAME, expect, screenshot, submit_login_form

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

AUDIT_LIST = "/admin/audit/auditevent/"


def test_login_shows_the_operator_and_log_out(logged_in_page):
    page = logged_in_page
    expect(page.get_by_role("banner")).to_contain_text(f"Welcome, {ADMIN_USERNAME}")
    expect(page.get_by_role("button", name="Log out")).to_be_visible()

    page.get_by_role("button", name="Log out").click()
    expect(page.get_by_role("link", name="Log in again")).to_be_visible()
    page.goto("/admin/")
    expect(page).to_have_url(re.compile(r"/admin/login/\?next=/admin/$"))


def test_wrong_password_is_refused_on_the_login_page(page):
    submit_login_form(page, ADMIN_USERNAME, "not-the-password")

    expect(page.get_by_text("Please enter the correct username and password")).to_be_visible()
    expect(page).to_have_url(re.compile(r"/admin/login/"))
    expect(page.get_by_role("button", name="Log in")).to_be_visible()
    expect(page.get_by_role("button", name="Log out")).to_have_count(0)


@pytest.mark.parametrize("path", ["/admin/", AUDIT_LIST])
def test_anonymous_visitor_is_sent_to_the_login_page(page, path):
    page.goto(path)

    expect(page).to_have_url(re.compile(rf"/admin/login/\?next={re.escape(path)}$"))
    expect(page.get_by_label("Username")).to_be_visible()
    expect(page.get_by_role("button", name="Log in")).to_be_visible()


def test_audit_log_is_browsable_and_read_only(logged_in_page, live_orchestrator):
    # a worker.created row beside an api_token.created one, both on the first page however many rows
    # the tests before this one wrote on the shared orchestrator
    live_orchestrator.manage("create_api_token", ADMIN_USERNAME, "--description", "audit-browse")
    created = live_orchestrator.admin("POST", "/api/admin/workers", json={"name": f"audit-{secrets.token_hex(4)}"})
    worker = expect_json(created, 201)
    page = logged_in_page
    page.goto(AUDIT_LIST)

    events = page.get_by_role("row").filter(has=page.locator(f'a[href*="{AUDIT_LIST}"][href*="/change/"]'))
    expect(events.filter(has_text="worker.created").filter(has_text=worker["worker_id"])).to_have_count(1)
    expect(events.filter(has_text="api_token.created").first).to_be_visible()
    expect(page.get_by_role("navigation", name="Filter")).to_be_visible()
    expect(page.locator(f'a[href$="{AUDIT_LIST}add/"]')).to_have_count(0)
    screenshot(page, "audit-list")

    # the filter sidebar narrows the list to one action
    page.get_by_role("navigation", name="Filter").get_by_role("link", name="api_token.created", exact=True).click()
    expect(page).to_have_url(re.compile(r"[?&]action=api_token\.created"))
    expect(events.filter(has_not_text="api_token.created")).to_have_count(0)
    expect(events.first).to_be_visible()

    # an event's page shows its details, read-only
    events.first.get_by_role("link").first.click()
    expect(page).to_have_url(re.compile(rf"{AUDIT_LIST}\d+/change/"))
    main = page.get_by_role("main")
    expect(main.get_by_text("api_token.created", exact=True)).to_be_visible()
    expect(main.get_by_text("token_prefix")).to_be_visible()
    expect(main.get_by_role("button", name=re.compile("Save"))).to_have_count(0)
    expect(main.locator("input:not([type=hidden]), textarea, select")).to_have_count(0)
    expect(page.locator('a[href$="/delete/"]')).to_have_count(0)
    assert live_orchestrator.admin_token not in page.content(), "the audit log shows an operator token in full"

    # adding an event by URL is refused, not merely hidden
    response = page.goto(f"{AUDIT_LIST}add/")
    assert response.status == 403, f"GET {AUDIT_LIST}add/ answered {response.status}"
