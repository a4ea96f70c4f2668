"""Browser tests of an operator's day: add a worker (token shown once), watch its agent go idle then busy
without reloading, submit a job from the form, drain, refuse a delete, rotate the token, read the audit trail.

One real daphne, one real ``python -m worker_agent`` running the example trainer, headless Chromium.
"""

import json
import re
import secrets
import socket

import pytest
from django.contrib.admin.utils import quote, unquote

from tests.e2e.agent_harness import job_in
from tests.e2e.harness import WorkerHandle

from .support import expect, screenshot

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

WORKERS = "/admin/workers/worker/"
JOBS = "/admin/queue/job/"
LIVE_S = 20_000  # ms: a status change reaches an open page through the change feed well within this


def _row(page, text):
    return page.locator("#result_list tbody tr").filter(has=page.get_by_role("link", name=text, exact=True))


def _add_worker(page, name, labels):
    page.goto(WORKERS)
    page.get_by_role("link", name="Add worker").click()
    page.get_by_label("Name").fill(name)
    page.get_by_label("Persistent").check()
    page.get_by_label("Labels").fill("\n".join(f"{k}={v}" for k, v in labels.items()))
    page.get_by_role("button", name="Create worker").click()
    expect(page.get_by_text("it is shown only this once")).to_be_visible()
    token = page.locator("#worker-token").inner_text().strip()
    command = page.locator("#agent-command").inner_text()
    return token, command


def test_operator_adds_a_worker_watches_it_work_drains_and_rotates(logged_in_page, live_orchestrator, agents):
    page = logged_in_page
    name = f"gpu-{secrets.token_hex(3)}"
    labels = {"pool": name}

    # Add worker: the token and a ready-to-paste command, once.
    token, command = _add_worker(page, name, labels)
    assert re.fullmatch(r"wt_[\w-]{20,}", token), token
    assert command.startswith(f"SIMPLETUNER_WORKER_TOKEN={token} .venv/bin/simpletuner worker --orchestrator-url http")
    assert f"--name {name} --persistent" in command
    page.get_by_role("link", name="Go to the worker").click()
    expect(page.locator("#content")).to_contain_text(name)
    assert token not in page.content()
    page.goto(f"{WORKERS}?q={name}")
    row = _row(page, name)
    expect(row.locator(".field-status_display")).to_contain_text("Connecting")
    assert token not in page.content()
    worker_id = row.locator("input.action-select").get_attribute("value")

    # The agent connects: the open page turns the worker idle, then busy, without a reload.
    page.evaluate("window.__not_reloaded = true")
    expect(page.locator("#st-live")).to_have_text("live", timeout=LIVE_S)
    handle = WorkerHandle(live_orchestrator, {"worker_id": worker_id, "name": name, "token": token})
    agent = agents.start(handle)
    expect(row.locator(".field-status_display")).to_contain_text("Idle", timeout=LIVE_S)

    # The worker's page names the agent that serves it: its name, its host and its instance.
    detail = page.context.new_page()
    detail.goto(f"{WORKERS}{quote(worker_id)}/change/")
    expect(detail.locator(".field-serving_agent_display")).to_contain_text(f"on {socket.gethostname()} · instance ")
    screenshot(detail, "worker-serving-agent")
    detail.close()

    # Submit a job from the form in a second tab; the first keeps watching.
    form = page.context.new_page()
    form.goto(f"{JOBS}add/")
    form.get_by_label("Config name").fill("browser-sgd")
    form.locator("#id_config").fill(json.dumps({"max_train_steps": 40, "step_delay": 0.1, "checkpoint_every": 0}))
    form.get_by_label("Target").select_option("worker")
    form.get_by_label("Label selectors").fill(f"pool={name}")
    form.get_by_role("button", name="Submit job").click()
    expect(form.locator(".messagelist")).to_contain_text(f"dispatched to {name}")
    job_id = unquote(re.search(r"/admin/queue/job/(j_\w+)/change/", form.url).group(1))

    expect(row.locator(".field-status_display")).to_contain_text("Busy", timeout=LIVE_S)
    expect(row.locator(".field-current_job_display")).to_contain_text("browser-sgd", timeout=LIVE_S)
    expect(row.locator(".field-heartbeat")).to_have_text(re.compile(r"^\d+ s ago$"))
    screenshot(page, "workers-list")
    assert page.evaluate("window.__not_reloaded") is True

    # The job completes; its page shows the attempt, the trainer's output and the audit trail.
    # ... while its page, left open, follows it to the end without a reload too.
    form.evaluate("window.__not_reloaded = true")
    job_in(live_orchestrator, job_id, "completed", timeout=60)
    expect(row.locator(".field-status_display")).to_contain_text("Idle", timeout=LIVE_S)
    expect(form.locator(".field-status_display")).to_contain_text("Completed", timeout=LIVE_S)
    expect(form.locator(".field-progress_bar")).to_contain_text("100%")
    assert form.evaluate("window.__not_reloaded") is True
    expect(form.locator(".st-log")).to_contain_text("step")
    expect(form.locator("#attempts-group")).to_contain_text(name)
    expect(form.locator(".st-audit")).to_contain_text("job.status_changed")
    expect(form.locator(".st-audit-more")).to_contain_text(f"audit rows for {job_id}")
    form.reload()  # the buttons are drawn for the status the page was loaded with
    expect(form.locator("#cancel-job")).to_have_count(0)
    screenshot(form, "job-detail")
    form.close()

    # Drain from the worker's page.
    page.goto(f"{WORKERS}{quote(worker_id)}/change/")
    page.locator("#drain-worker").click()
    expect(page.locator("#confirm-changes")).to_contain_text("it takes no new job")  # asked first
    page.locator("#confirm-yes").click()
    expect(page.locator(".messagelist")).to_contain_text(f"Draining: {name}")
    expect(page.locator(".field-status_display")).to_contain_text("Draining")

    # Delete is refused while the worker is online.
    page.locator("#delete-worker").click()
    expect(page.locator(".messagelist .error")).to_contain_text(
        f"Refused: worker {name} is draining; only an offline worker can be deleted"
    )
    assert live_orchestrator.admin("GET", f"/api/admin/workers/{worker_id}").status_code == 200

    # Rotate: a new token, shown once; the old one stops working and the agent is told so.
    page.locator("#rotate-token").click()
    expect(page.locator("#confirm-changes")).to_contain_text("must be restarted with the new token")
    page.locator("#confirm-yes").click()
    expect(page.locator("#content-main h2")).to_contain_text("has a new token")
    new_token = page.locator("#worker-token").inner_text().strip()
    assert new_token != token and new_token.startswith("wt_")
    stale = live_orchestrator.as_worker(token, "POST", "/api/workers/heartbeat", json={})
    assert stale.status_code == 401
    # The agent learns it from whichever reaches it first: the stream's shutdown (token_revoked), or a
    # heartbeat refused with 401; either way a rotated token is fatal: it needs the new one.
    agent.wait_for_line(
        re.compile(r"closed this worker's stream: token rotated|invalid token: the orchestrator refused it .*rotated"),
        timeout=30,
    )
    assert agent.wait_exit() == 1

    # The audit trail names the operator for each of those actions.
    page.goto(f"/admin/audit/auditevent/?q={worker_id}")
    for action in ("worker.created", "worker.drain_requested", "worker.token_rotated", "worker.status_changed"):
        expect(page.locator("#result_list")).to_contain_text(action)
    expect(page.locator("#result_list")).to_contain_text("user: admin")
    screenshot(page, "audit-worker-trail")


def test_a_job_form_with_bad_json_is_refused_and_submits_nothing(logged_in_page, live_orchestrator):
    page = logged_in_page
    before = live_orchestrator.admin("GET", "/api/queue/").json()["count"]
    page.goto(f"{JOBS}add/")
    page.get_by_label("Config name").fill("broken")
    page.locator("#id_config").fill('{"learning_rate": 0.1,}')
    page.get_by_role("button", name="Submit job").click()

    expect(page.locator(".field-config .errorlist")).to_contain_text("Enter a valid JSON")
    page.locator("#id_config").fill("[1, 2]")
    page.get_by_role("button", name="Submit job").click()
    expect(page.locator(".field-config .errorlist")).to_contain_text("config must be a JSON object")
    assert live_orchestrator.admin("GET", "/api/queue/").json()["count"] == before


def test_the_index_shows_the_fleet_at_a_glance(logged_in_page):
    page = logged_in_page
    overview = page.locator("#fleet-overview")
    expect(overview).to_contain_text("Fleet at a glance")
    for label in ("Idle", "Busy", "Draining", "Offline", "Queued", "Running", "Recent failures"):
        expect(overview).to_contain_text(label)
    expect(page.locator("#st-live")).to_have_text("live", timeout=LIVE_S)
