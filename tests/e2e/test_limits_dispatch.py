"""A team's running-jobs limit end to end (issue 29): a real orchestrator over HTTP (SQLite, and PostgreSQL + Redis)
holds the team's second job back with a waiting_reason naming the limit, and dispatches it, to another idle worker,
as soon as the first job ends."""

import pytest
import requests

from worker_agent import protocol

from .harness import expect, poll

pytestmark = pytest.mark.e2e


def operator(orchestrator, username):
    """Create ``username`` in the shipped operator group (manage.py create_api_token --group); return a session."""
    token = orchestrator.manage("create_api_token", username, "--group", "operator").strip().splitlines()[-1]
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"
    return session


def test_a_team_at_its_limit_waits_with_the_reason_and_goes_when_its_job_ends(orchestrator, fleet):
    alice, team = f"alice-{fleet.tag}", f"limited-{fleet.tag}"
    as_alice = operator(orchestrator, alice)
    expect(orchestrator.admin("POST", "/api/admin/teams", json={"name": team, "members": [alice]}), 201)
    expect(orchestrator.admin("PUT", f"/api/admin/teams/{team}/limits", json={"max_running_jobs": 1}), 200)
    first_worker = fleet.create_worker(labels={"pool": fleet.tag})
    other_worker = fleet.create_worker(labels={"pool": f"{fleet.tag}-a100"})
    for worker in (first_worker, other_worker):
        worker.register({"name": worker.name, "gpu_count": 1})
    first_stream, other_stream = fleet.open_stream(first_worker), fleet.open_stream(other_worker)

    def submit(pool):
        body = {"config_name": "e2e-limits", "worker_labels": {"pool": pool}}
        return expect(as_alice.post(orchestrator.url("/api/queue/submit"), json=body), 201)

    running = submit(fleet.tag)
    assert running["dispatched"] is True
    lease = first_stream.wait_for(protocol.JOB_SUBMIT).json()["attempt"]
    first_worker.report(running["job_id"], "running", attempt=lease)

    # Only the other worker fits the second job, and it is idle: the team's limit holds the job back.
    held = submit(f"{fleet.tag}-a100")
    assert held["dispatched"] is False
    shown = expect(as_alice.get(orchestrator.url(f"/api/queue/{held['job_id']}")), 200)
    assert shown["status"] == "queued"
    assert shown["waiting_reason"] == f"team {team} is at its limit of 1 running job"
    assert isinstance(shown["queue_position"], int) and shown["queue_position"] >= 1
    other_stream.assert_no_event(protocol.JOB_SUBMIT, within=0.5)

    # The first job ends on its worker, which the held job does not fit: it goes to the other worker at once.
    first_worker.report(running["job_id"], "completed", attempt=lease)
    submitted = other_stream.wait_for(protocol.JOB_SUBMIT).json()
    assert submitted["job_id"] == held["job_id"]
    job = poll(
        lambda: (found := expect(as_alice.get(orchestrator.url(f"/api/queue/{held['job_id']}")), 200))["status"] == "dispatched"
        and found,
        timeout=10,
        message="the held job dispatched",
    )
    assert (job["worker_id"], job["queue_position"], job["waiting_reason"]) == (other_worker.id, None, None)
