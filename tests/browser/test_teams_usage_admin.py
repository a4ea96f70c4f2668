"""The Teams and GPU usage admin pages in real Chromium (issue 29): add a team with a member and limits, read the
team list with each team's usage, and the usage page (table, weekly chart, quota standing, CSV export).
Screenshots in test-artifacts/browser/teams-*.png and usage-*.png."""

import re
import secrets
import time

import pytest

from tests.e2e.harness import expect as expect_json
from worker_agent import protocol

from .support import ADMIN_USERNAME, expect, screenshot

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


def run_a_team_job(orchestrator, fleet, team):
    """Run one job charged to ``team`` on a scripted 2-GPU worker: acknowledged, 0.3 s, completed."""
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    worker.register({"name": worker.name, "gpu_count": 2})
    stream = fleet.open_stream(worker)
    job = fleet.submit({"config_name": "browser-usage", "worker_labels": {"pool": fleet.tag}, "team": team})
    lease = stream.wait_for(protocol.JOB_SUBMIT).json()["attempt"]
    worker.report(job["job_id"], "running", attempt=lease)
    time.sleep(0.3)  # GPU time to charge
    worker.report(job["job_id"], "completed", attempt=lease)
    return job


def test_an_admin_adds_a_team_with_a_member_and_limits(logged_in_page, live_orchestrator):
    member = f"member-{secrets.token_hex(3)}"
    live_orchestrator.manage("create_api_token", member, "--group", "viewer")
    name = f"vision-{secrets.token_hex(3)}"
    page = logged_in_page
    page.goto("/admin/tenancy/team/add/")

    page.get_by_label("Name").fill(name)
    page.locator("#id_members_from").select_option(label=member)
    page.locator("#id_members_add").click()
    page.get_by_label("Max running jobs").fill("2")
    page.get_by_label("GPU-hours per 30 days").fill("40")
    screenshot(page, "teams-add")
    page.get_by_role("button", name="Save", exact=True).click()

    expect(page.locator(".messagelist")).to_contain_text("was added successfully")
    row = page.get_by_role("row").filter(has_text=name)
    expect(row).to_contain_text(member)
    expect(row).to_contain_text("2 running jobs, 40 GPU-h / 30 days")
    screenshot(page, "teams-list")
    team = expect_json(live_orchestrator.admin("GET", f"/api/admin/teams/{name}"), 200)
    assert team["members"] == [member] and team["limits"]["gpu_hours_per_30_days"] == 40.0


def test_the_usage_page_shows_the_table_the_weekly_chart_quotas_and_exports_csv(logged_in_page, live_orchestrator, tmp_path):
    from tests.e2e.harness import Fleet

    fleet = Fleet(live_orchestrator, "browser-usage")
    team = f"nlp-{fleet.tag}"
    expect_json(live_orchestrator.admin("POST", "/api/admin/teams", json={"name": team, "members": [ADMIN_USERNAME]}), 201)
    try:
        run_a_team_job(live_orchestrator, fleet, team)
    finally:
        fleet.cleanup()
    rows = expect_json(live_orchestrator.admin("GET", "/api/usage", params={"group_by": "team"}), 200)["rows"]
    (used,) = [row["gpu_seconds"] for row in rows if row["key"] == team]
    quota = {"gpu_hours_per_30_days": used / 3600 / 0.9}  # 90% of it used: near
    expect_json(live_orchestrator.admin("PUT", f"/api/admin/teams/{team}/limits", json=quota), 200)
    page = logged_in_page

    page.goto("/admin/tenancy/team/")
    expect(page.get_by_role("row").filter(has_text=team)).to_be_visible()
    page.get_by_role("link", name="GPU usage").click()
    expect(page).to_have_url(re.compile(r"/admin/tenancy/team/usage/$"))
    page.get_by_label("Group by").select_option("team")
    page.get_by_role("button", name="Show").click()

    row = page.locator("#usage-table tbody tr").filter(has_text=team)
    expect(row).to_be_visible()
    expect(page.locator("#usage-chart rect.st-usage-bar")).not_to_have_count(0)
    quota = page.locator("#quota-standing tr").filter(has_text=team)
    expect(quota).to_contain_text("90% near")
    screenshot(page, "usage-page")

    with page.expect_download() as download:
        page.get_by_role("link", name="Export CSV").click()
    saved = tmp_path / "usage.csv"
    download.value.save_as(saved)
    lines = saved.read_text().splitlines()
    assert lines[0] == "key,gpu_seconds,gpu_hours,jobs,attempts"
    assert any(line.startswith(f"{team},") for line in lines[1:])
