"""Issue 14.9 over real HTTP: list items carry their url and, when queued, why they wait; the worker
stream answers another method with a JSON 405 (not a CSRF page); an ``auto`` job with labels says why
it does not fall back to the local worker."""

import pytest
import requests

from .harness import expect

pytestmark = pytest.mark.e2e


def test_list_items_carry_their_url_and_queued_jobs_their_waiting_reason(orchestrator, fleet):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    submitted = fleet.submit({"config_name": "e2e-list", "worker_labels": {"pool": fleet.tag}})
    assert submitted["url"] == orchestrator.url(f"/api/queue/{submitted['job_id']}")

    listed = expect(orchestrator.admin("GET", "/api/queue/", params={"status": "queued", "limit": 1000}), 200)["results"]
    (mine,) = [job for job in listed if job["id"] == submitted["job_id"]]
    detail = orchestrator.job(mine["id"])
    assert mine["waiting_reason"] == detail["waiting_reason"] == "1 worker matches but none is available (1 connecting)"
    assert expect(orchestrator.admin("GET", mine["url"].removeprefix(orchestrator.base_url)), 200)["id"] == mine["id"]

    workers = expect(orchestrator.admin("GET", "/api/admin/workers"), 200)["workers"]
    (listed_worker,) = [w for w in workers if w["id"] == worker.id]
    assert listed_worker["url"] == orchestrator.url(f"/api/admin/workers/{worker.id}")
    expect(orchestrator.admin("POST", f"/api/queue/{submitted['job_id']}/cancel"), 200)


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE"])
def test_another_method_on_the_worker_stream_is_a_json_405(orchestrator, fleet, method):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    for headers in ({}, {"X-Worker-Token": worker.token}):
        response = requests.request(method, orchestrator.url("/api/workers/stream"), headers=headers, timeout=10)
        assert response.status_code == 405, response.text[:300]
        assert response.headers["Content-Type"].startswith("application/json")
        assert response.headers["Allow"] == "GET"
        assert response.json()["code"] == "method_not_allowed"
        assert "CSRF" not in response.text


def test_an_auto_job_with_labels_says_why_it_does_not_fall_back_to_the_local_worker(orchestrator, fleet):
    submitted = fleet.submit({"config_name": "e2e-auto", "target": "auto", "worker_labels": {"pool": f"{fleet.tag}-none"}})
    assert submitted["status"] == "queued"
    reason = submitted["waiting_reason"]
    assert reason.startswith(f"no worker with >= 0 GPUs matches labels pool={fleet.tag}-none; auto")
    assert "local worker" in reason
    expect(orchestrator.admin("POST", f"/api/queue/{submitted['job_id']}/cancel"), 200)
