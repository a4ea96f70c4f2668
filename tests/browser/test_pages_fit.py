"""Browser tests of issue 32.9's smaller fixes, in real Chromium, each leaving screenshots in
test-artifacts/browser/: the lists and the index fit a 1,400 px window, a short job's page shows the newest
audit rows with a link to all of them, "Recent actions" is the audit log, /api/docs/ signed out leads to
sign-in and back, and the token page's agent command runs as the README sets things up."""

import os
import re
import secrets
import signal
import subprocess

import pytest
from django.contrib.admin.utils import quote

from tests.e2e.agent_harness import job_in
from tests.e2e.harness import REPO_ROOT, poll

from .support import ADMIN_PASSWORD, ADMIN_USERNAME, expect, screenshot

pytestmark = [pytest.mark.browser, pytest.mark.e2e]

WIDTH = 1400
LONG_LABELS = {"gpu_type": "h100-80g-hbm3", "region": "europe-west4-a", "pool": "production-training", "tier": "spot-preemptible"}
# Its checkpoints and its output files each write audit rows: 15 or so in all, in about 10 s.
CHECKPOINTING_JOB = {"max_train_steps": 100, "step_delay": 0.05, "checkpoint_every": 25}

# Every element that scrolls sideways (a list's .results, the page itself), with how far it overflows.
OVERFLOWING = """() => [document.documentElement, ...document.querySelectorAll('#changelist .results, #content-main, .module')]
    .filter(e => e.scrollWidth > e.clientWidth + 1)
    .map(e => `${e.tagName}#${e.id}.${e.className}: ${e.scrollWidth} > ${e.clientWidth}`)"""


def _busy_looking_fleet(agents, tag):
    """Two registered workers the way a real fleet shows them (8 H100s, four long labels) and a completed job."""
    for n in range(2):
        worker = agents.fleet.create_worker(labels={**LONG_LABELS, "rack": f"r{tag}-{n}"})
        worker.register(
            {
                "name": worker.name,
                "gpu_count": 8,
                "gpu_name": "NVIDIA H100 80GB HBM3",
                "gpu_vram_gb": 79.6,
                "accelerator_type": "cuda",
                "hostname": f"gpu-node-{tag}-{n}.europe-west4-a.c.example-project.internal",
            }
        )
    runner = agents.fleet.create_worker(labels={"pool": f"fit-{tag}"})
    agents.wait_ready(agents.start(runner))
    job_id = agents.submit(
        labels={"pool": f"fit-{tag}"}, config=CHECKPOINTING_JOB, config_name=f"sdxl-lora-portrait-photography-{tag}-v2"
    )["job_id"]
    job_in(agents.orch, job_id, "completed", timeout=60)
    return job_id


def test_the_lists_and_the_index_fit_1400_px_and_a_short_jobs_page_is_short(logged_in_page, agents):
    page = logged_in_page
    tag = secrets.token_hex(3)
    job_id = _busy_looking_fleet(agents, tag)
    assert page.viewport_size["width"] == WIDTH

    for path, shot in (("/admin/", "index-1400px"), ("/admin/workers/worker/", "workers-1400px"), ("/admin/queue/job/", "jobs-1400px")):
        page.goto(path)
        expect(page.locator("#content")).to_be_visible()
        screenshot(page, shot)
        assert page.evaluate(OVERFLOWING) == [], path
    page.goto("/admin/workers/worker/")
    expect(page.locator("#result_list")).to_contain_text("8× NVIDIA H100 80GB HBM3")

    page.goto(f"/admin/queue/job/{quote(job_id)}/change/")
    trail = page.locator(".st-audit tbody tr")
    expect(trail).to_have_count(5)
    more = page.locator(".st-audit-more")
    expect(more).to_contain_text(re.compile(r"Showing the newest 5 of (\d+): all \1 audit rows for " + job_id))
    total = int(re.search(r"of (\d+)", more.inner_text()).group(1))
    assert total > 10  # the job wrote many rows; the page shows five
    audit_height = page.evaluate("() => document.querySelector('.st-audit').getBoundingClientRect().height")
    page_height = page.evaluate("() => document.documentElement.scrollHeight")
    screenshot(page, "job-detail-short-audit")
    assert audit_height < 600 and page_height < 4000, (audit_height, page_height)
    assert page.evaluate(OVERFLOWING) == []

    more.get_by_role("link").click()
    expect(page.locator("#result_list tbody tr")).to_have_count(total)
    expect(page.locator("#result_list tbody td.field-target")).to_have_text([f"job:{job_id}"] * total)  # the job's own


def test_recent_actions_on_the_index_are_the_audit_log(logged_in_page, live_orchestrator):
    page = logged_in_page
    name = f"recent-{secrets.token_hex(3)}"
    live_orchestrator.admin("POST", "/api/admin/workers", json={"name": name, "labels": {}})
    page.goto("/admin/")
    recent = page.locator("#recent-actions-module")
    expect(recent).to_contain_text("The audit log, newest first")
    expect(recent.locator("li").first).to_contain_text("worker.created")
    expect(recent).not_to_contain_text("My actions")
    screenshot(page, "index-recent-actions")
    recent.locator("li").first.get_by_role("link").click()
    expect(page.locator("#content")).to_contain_text(name)


def test_the_api_docs_signed_out_lead_to_sign_in_and_back(page):
    page.goto("/api/docs/")
    expect(page).to_have_url(re.compile(r"/api-auth/login/\?next=/api/docs/$"))
    screenshot(page, "api-docs-sign-in")
    page.get_by_label("Username").fill(ADMIN_USERNAME)
    page.get_by_label("Password").fill(ADMIN_PASSWORD)
    page.get_by_role("button", name=re.compile("Log in", re.I)).click()
    expect(page).to_have_url(re.compile(r"/api/docs/$"))
    expect(page.locator("#swagger-ui")).to_contain_text("SimpleTuner orchestrator API", timeout=20_000)
    screenshot(page, "api-docs-signed-in")


def test_the_token_pages_agent_command_runs_from_the_readmes_checkout(logged_in_page, tmp_path):
    page = logged_in_page
    name = f"paste-{secrets.token_hex(3)}"
    page.goto("/admin/workers/worker/add/")
    page.get_by_label("Name").fill(name)
    page.get_by_label("Persistent").check()
    page.get_by_role("button", name="Create worker").click()
    command = page.locator("#agent-command").inner_text().strip()
    expect(page.locator("#agent-command-where")).to_contain_text("make install")
    screenshot(page, "worker-token-command")
    assert " .venv/bin/simpletuner worker --orchestrator-url " in command

    # Pasted into a shell in the checkout, as the README sets it up (HOME: its job directories stay here).
    log = tmp_path / "agent.log"
    with open(log, "wb") as out:
        agent = subprocess.Popen(
            ["bash", "-c", command], cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, "HOME": str(tmp_path)}, start_new_session=True,
        )  # fmt: skip
    try:
        poll(lambda: f"Registered as {name}" in log.read_text(), timeout=30, message=f"the pasted command to register\n{log.read_text()}")
    finally:
        os.killpg(agent.pid, signal.SIGTERM)
        agent.wait(timeout=30)
    assert "command not found" not in log.read_text()
