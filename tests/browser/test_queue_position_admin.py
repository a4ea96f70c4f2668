"""The admin's job page in real Chromium (issue 29): a queued job held back by its team's limit shows its place in
the queue and why it waits. Screenshot in test-artifacts/browser/job-queue-position.png."""

import re

import pytest
from django.contrib.admin.utils import quote

from tests.e2e.harness import Fleet
from tests.e2e.harness import expect as expect_json

from .support import ADMIN_USERNAME, expect, screenshot

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


def test_a_held_jobs_page_shows_its_place_in_the_queue_and_the_limit(logged_in_page, live_orchestrator):
    fleet = Fleet(live_orchestrator, "browser-position")
    team = f"held-{fleet.tag}"
    expect_json(live_orchestrator.admin("POST", "/api/admin/teams", json={"name": team, "members": [ADMIN_USERNAME]}), 201)
    expect_json(live_orchestrator.admin("PUT", f"/api/admin/teams/{team}/limits", json={"max_running_jobs": 0}), 200)
    try:
        worker = fleet.create_worker(labels={"pool": fleet.tag})
        worker.register({"name": worker.name, "gpu_count": 1})
        fleet.open_stream(worker)
        job = fleet.submit({"config_name": "browser-held", "worker_labels": {"pool": fleet.tag}, "team": team})
        shown = expect_json(live_orchestrator.admin("GET", f"/api/queue/{job['job_id']}"), 200)
        assert shown["status"] == "queued" and shown["queue_position"] >= 1
        page = logged_in_page

        page.goto(f"/admin/queue/job/{quote(job['job_id'])}/change/")

        place = page.locator(".field-queue_position .readonly")
        expect(place).to_have_text(str(shown["queue_position"]))
        expect(page.locator(".field-waiting .readonly")).to_have_text(re.compile(f"team {team} is at its limit of 0 running jobs"))
        screenshot(page, "job-queue-position")
    finally:
        live_orchestrator.admin("POST", f"/api/queue/{job['job_id']}/cancel")
        fleet.cleanup()
