"""Browser tests of issue 14's admin features, in real Chromium, each leaving screenshots in
test-artifacts/browser/: confirmation pages before every change (rotating a busy worker names its job),
putting a drained worker back in service, editing labels, creating an API token (shown once, with an
expiry) and revoking it."""

import re
import secrets

import pytest
from django.contrib.admin.utils import quote

from tests.e2e.agent_harness import job_mid_run

from .support import expect, screenshot

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

WORKERS = "/admin/workers/worker/"
JOBS = "/admin/queue/job/"
TOKENS = "/admin/workers/token/"
LONG_JOB = {"max_train_steps": 2000, "step_delay": 0.05}


def _worker_page(page, worker_id):
    page.goto(f"{WORKERS}{quote(worker_id)}/change/")


def test_rotating_a_busy_worker_asks_naming_its_job_which_is_requeued_without_a_retry(logged_in_page, live_orchestrator, agents):
    page = logged_in_page
    pool = f"rot-{secrets.token_hex(3)}"
    worker = agents.fleet.create_worker(labels={"pool": pool})
    agent = agents.start(worker)
    agents.wait_ready(agent)
    job_id = agents.submit(labels={"pool": pool}, config=LONG_JOB, max_retries=0)["job_id"]
    job_mid_run(live_orchestrator, job_id)

    _worker_page(page, worker.id)
    page.locator("#rotate-token").click()
    changes = page.locator("#confirm-changes")
    expect(changes).to_contain_text(f"job {job_id} (e2e-agent, running) is stopped and goes back to the queue without spending a retry")
    expect(page.locator("#confirm-yes")).to_have_value(f"Yes, rotate its token and stop job {job_id}")
    screenshot(page, "confirm-rotate-busy-worker")
    page.locator("#confirm-no").click()  # "No" changes nothing
    expect(page.locator(".field-status_display")).to_contain_text("Busy")
    assert live_orchestrator.job(job_id)["status"] == "running"

    page.locator("#rotate-token").click()
    page.locator("#confirm-yes").click()
    expect(page.locator("#content-main h2")).to_contain_text("has a new token")
    job = live_orchestrator.job(job_id)
    assert (job["status"], job["retry_count"]) == ("queued", 0)
    assert [a["outcome"] for a in job["attempts"]] == ["interrupted"]
    assert agent.wait_exit(timeout=20) == 1
    live_orchestrator.admin("POST", f"/api/queue/{job_id}/cancel")


def test_drain_then_put_back_in_service_and_edit_labels(logged_in_page, live_orchestrator, agents):
    page = logged_in_page
    pool = f"lab-{secrets.token_hex(3)}"
    worker = agents.fleet.create_worker(labels={"pool": pool, "team": "nlp"})
    agent = agents.start(worker)
    agents.wait_ready(agent)

    _worker_page(page, worker.id)
    page.locator("#drain-worker").click()
    expect(page.locator("#confirm-changes")).to_contain_text("status idle → draining")
    screenshot(page, "confirm-drain")
    page.locator("#confirm-yes").click()
    expect(page.locator(".field-status_display")).to_contain_text("Draining")

    page.locator("#undrain-worker").click()
    expect(page.locator("#confirm-changes")).to_contain_text("status draining → idle")
    screenshot(page, "confirm-undrain")
    page.locator("#confirm-yes").click()
    expect(page.locator(".messagelist")).to_contain_text(f"Back in service: {worker.name}")
    expect(page.locator(".field-status_display")).to_contain_text("Idle")
    agent.wait_for_line("Back in service: this worker takes jobs again", timeout=20)

    # A queued job for team=vision waits; relabelling the worker dispatches it at once.
    queued = live_orchestrator.admin(
        "POST", "/api/queue/submit", json={"config_name": "relabel", "config": {"max_train_steps": 5}, "worker_labels": {"pool": pool, "team": "vision"}}
    ).json()
    assert queued["dispatched"] is False
    page.locator("#edit-labels").click()
    labels = page.locator("#id_labels")
    expect(labels).to_have_value(re.compile(r"team=nlp"))
    labels.fill(f"pool={pool}\nteam=vision")
    screenshot(page, "edit-labels")
    page.get_by_role("button", name="Save labels").click()
    expect(page.locator(".messagelist")).to_contain_text("Queued jobs were matched again")
    expect(page.locator(".field-labels_display")).to_contain_text("team=vision")
    assert live_orchestrator.job(queued["job_id"])["worker_id"] == worker.id
    rows = live_orchestrator.audit(target_id=worker.id, action="worker.labels_changed")
    assert rows and rows[0]["details"]["to"]["team"] == "vision"


def test_cancel_and_retry_ask_first(logged_in_page, live_orchestrator):
    page = logged_in_page
    job = live_orchestrator.admin(
        "POST", "/api/queue/submit", json={"config_name": "confirm-me", "worker_labels": {"pool": "nobody-" + secrets.token_hex(3)}}
    ).json()
    page.goto(f"{JOBS}{quote(job['job_id'])}/change/")
    page.locator("#cancel-job").click()
    expect(page.locator("#confirm-changes")).to_contain_text("status queued → cancelled")
    screenshot(page, "confirm-cancel")
    assert live_orchestrator.job(job["job_id"])["status"] == "queued"
    page.locator("#confirm-yes").click()
    expect(page.locator(".messagelist")).to_contain_text(f"Cancelled {job['job_id']}")

    page.reload()
    page.locator("#retry-job").click()
    expect(page.locator("#confirm-changes")).to_contain_text(f"retry_of {job['job_id']}")
    screenshot(page, "confirm-retry")
    page.locator("#confirm-yes").click()
    expect(page.locator(".messagelist")).to_contain_text(f"Retried {job['job_id']} as")


def test_create_an_api_token_shown_once_with_an_expiry_then_revoke_it(logged_in_page, live_orchestrator):
    page = logged_in_page
    description = f"ci-{secrets.token_hex(3)}"
    page.goto(TOKENS)
    page.get_by_role("link", name="Add token").click()
    page.get_by_label("Description").fill(description)
    page.get_by_label("in 7 days").check()
    screenshot(page, "token-create-form")
    page.get_by_role("button", name="Create token").click()
    expect(page.get_by_text("it is shown only this once")).to_be_visible()
    token = page.locator("#api-token").inner_text().strip()
    assert token.startswith("sta_")
    screenshot(page, "token-shown-once")
    works = live_orchestrator.request("GET", "/api/queue/", headers={"Authorization": f"Bearer {token}"})
    assert works.status_code == 200

    page.goto(f"{TOKENS}?q=")
    row = page.locator("#result_list tbody tr").filter(has_text=description)
    expect(row).to_contain_text("active")
    assert token not in page.content()
    row.locator("input.action-select").check()
    page.locator("select[name=action]").select_option("revoke_api_tokens")
    page.locator("button[name=index]").click()
    expect(page.locator("#confirm-changes")).to_contain_text(description)
    screenshot(page, "confirm-revoke-token")
    page.locator("#confirm-yes").click()
    expect(page.locator(".messagelist")).to_contain_text("Revoked 1 API token(s)")
    refused = live_orchestrator.request("GET", "/api/queue/", headers={"Authorization": f"Bearer {token}"})
    assert refused.status_code == 401


def test_the_whole_log_is_followed_live_and_downloaded_from_the_job_page(logged_in_page, live_orchestrator, agents):
    page = logged_in_page
    pool = f"log-{secrets.token_hex(3)}"
    worker = agents.fleet.create_worker(labels={"pool": pool})
    agent = agents.start(worker)
    agents.wait_ready(agent)
    job_id = agents.submit(labels={"pool": pool}, config={"max_train_steps": 600, "step_delay": 0.01, "checkpoint_every": 2})["job_id"]
    job_mid_run(live_orchestrator, job_id)

    page.goto(f"{JOBS}{quote(job_id)}/change/")
    chart = page.locator("#progress-chart")
    expect(chart).to_be_visible(timeout=30_000)  # drawn once two samples arrived; the page refreshes it live
    expect(chart.locator("polyline.st-chart-step")).to_have_count(1)
    expect(chart.locator("polyline.st-chart-loss")).to_have_count(1)
    screenshot(page, "job-progress-chart")
    page.locator("#full-log-link").click()
    log = page.locator("#full-log")
    expect(log).to_contain_text(f"# --- attempt 1 on {worker.name}")
    expect(page.locator("#full-log-state")).to_contain_text("following the job")
    before = log.inner_text()
    expect(page.locator("#full-log-state")).to_have_text("the job has finished", timeout=60_000)  # it followed the job live
    after = log.inner_text()
    assert len(after) > len(before) and "(completed)" in after
    assert after.count("\n") > 100  # every line, not the 50-line tail
    screenshot(page, "job-whole-log")
    with page.expect_download() as download:
        page.locator("#full-log-download").click()
    assert download.value.suggested_filename == f"{job_id}.log"


def test_the_index_dashboard_and_the_workers_list_at_1400_px(logged_in_page, live_orchestrator, agents):
    page = logged_in_page
    tag = secrets.token_hex(3)
    labels = {"gpu_type": "a100-sxm4-80g", "location": "datacenter-frankfurt-a", "team": "vision-research", "tier": "spot", "rack": f"r{tag}"}
    worker = agents.fleet.create_worker(labels=labels)
    agent = agents.start(worker)
    agents.wait_ready(agent)
    live_orchestrator.admin(
        "POST", "/api/queue/submit", json={"config_name": f"waits-{tag}", "worker_labels": {"team": f"nobody-{tag}"}}
    )

    page.goto("/admin/")
    overview = page.locator("#fleet-overview")
    expect(overview.locator("#fleet-gpus")).to_contain_text("GPUs online")
    expect(overview.locator("#fleet-oldest")).to_contain_text("Next in line:")
    expect(overview.locator("#fleet-stuck")).to_contain_text("Stuck?")
    screenshot(page, "index-fleet-dashboard")

    page.goto(f"{WORKERS}?q={worker.name}")
    expect(page.locator("#result_list")).to_contain_text("datacenter-frankfurt-a")
    widths = page.evaluate(
        "() => ({table: document.querySelector('#result_list').scrollWidth,"
        " room: document.querySelector('#changelist').clientWidth, page: document.documentElement.scrollWidth})"
    )
    screenshot(page, "workers-list-1400px")
    assert widths["table"] <= widths["room"] and widths["page"] <= 1400, widths
