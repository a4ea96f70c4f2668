"""The admin in real Chromium (issue 30, packing): a worker running several jobs at once shows its free GPUs and each
job with its GPUs; a job's page shows its GPUs beside its worker. The agent is scripted over HTTP (register with
max_jobs and gpu_slots, open its stream, acknowledge). Screenshots in test-artifacts/browser/packing-*.png."""

import pytest
from django.contrib.admin.utils import quote

from tests.e2e.harness import Fleet

from .support import expect, screenshot

pytestmark = [pytest.mark.browser, pytest.mark.e2e]


def test_a_packing_workers_gpus_in_use_are_shown_per_worker_and_per_job(logged_in_page, live_orchestrator):
    fleet = Fleet(live_orchestrator, "browser-packing")
    jobs = []
    try:
        worker = fleet.create_worker(labels={"pool": fleet.tag})
        answer = worker.register({"name": worker.name, "gpu_count": 4, "max_jobs": 4, "gpu_slots": [0, 1, 2, 3]})
        assert answer["max_jobs"] == 4
        stream = fleet.open_stream(worker)
        for gpus in (1, 2):
            body = {"config_name": f"browser-packed-{gpus}", "worker_labels": {"pool": fleet.tag}, "gpu_count": gpus}
            jobs.append(fleet.submit(body)["job_id"])
        for _ in jobs:
            submitted = stream.wait_for("job_submit").json()
            worker.report(submitted["job_id"], "starting", attempt=submitted["attempt"])
        state = worker.state()
        assert state["gpus_free"] == 1 and len(state["running_jobs"]) == 2, state
        page = logged_in_page

        page.goto(f"/admin/workers/worker/?q={worker.name}")
        row = page.locator("#result_list tbody tr").filter(has_text=worker.name)
        expect(row.locator(".field-gpus")).to_contain_text("1 free, up to 4 jobs")
        expect(row.locator(".field-current_job_display")).to_contain_text("browser-packed-1 GPUs 0")
        expect(row.locator(".field-current_job_display")).to_contain_text("browser-packed-2 GPUs 1,2")
        screenshot(page, "packing-workers")

        page.goto(f"/admin/queue/job/{quote(jobs[1])}/change/")
        expect(page.locator(".field-worker_display .readonly")).to_contain_text("GPUs 1,2")
        expect(page.locator("td.field-gpus_display").first).to_have_text("1,2")  # its attempt's
        screenshot(page, "packing-job")
    finally:
        for job_id in jobs:
            live_orchestrator.admin("POST", f"/api/queue/{job_id}/cancel")
        fleet.cleanup()
