"""Teams, usage and quotas end to end (issue 29): a real orchestrator over HTTP (SQLite, and PostgreSQL + Redis);
a job submitted with a team runs on a worker, its GPU time is charged in GET /api/usage and /metrics, and once the
team's GPU-hour quota is used up its next submit is refused."""

import time
from datetime import datetime

import pytest
import requests

from worker_agent import protocol

from .agent_harness import job_in
from .harness import expect

pytestmark = pytest.mark.e2e

QUICK_JOB = {"max_train_steps": 5, "step_delay": 0.02}


def operator(orchestrator, username):
    """Create ``username`` in the shipped operator group (manage.py create_api_token --group); return a session."""
    token = orchestrator.manage("create_api_token", username, "--group", "operator").strip().splitlines()[-1]
    session = requests.Session()
    session.headers["Authorization"] = f"Bearer {token}"
    return session


def test_a_team_job_is_charged_its_gpu_time_and_a_used_up_quota_refuses_the_next(orchestrator, fleet):
    alice, team = f"alice-{fleet.tag}", f"team-{fleet.tag}"
    as_alice = operator(orchestrator, alice)
    created = expect(orchestrator.admin("POST", "/api/admin/teams", json={"name": team, "members": [alice]}), 201)
    assert created["members"] == [alice]
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    worker.register({"name": worker.name, "gpu_count": 2})
    stream = fleet.open_stream(worker)

    submitted = expect(
        as_alice.post(orchestrator.url("/api/queue/submit"), json={"config_name": "e2e-usage", "worker_labels": {"pool": fleet.tag}}), 201
    )
    assert (submitted["team"], submitted["submitted_by"], submitted["dispatched"]) == (team, alice, True)
    job_id = submitted["job_id"]
    lease = stream.wait_for(protocol.JOB_SUBMIT).json()["attempt"]
    worker.report(job_id, "running", attempt=lease)  # the acknowledgement: the charge starts
    time.sleep(0.5)  # GPU time to charge (nothing is awaited)
    worker.report(job_id, "completed", attempt=lease)

    job = expect(as_alice.get(orchestrator.url(f"/api/queue/{job_id}")), 200)
    (attempt,) = job["attempts"]
    held = datetime.fromisoformat(attempt["finished_at"]) - datetime.fromisoformat(attempt["started_at"])
    assert held.total_seconds() >= 0.5
    by_team = expect(as_alice.get(orchestrator.url("/api/usage"), params={"group_by": "team"}), 200)
    assert by_team["only_mine"] is False  # an operator reads everyone's usage
    (row,) = [r for r in by_team["rows"] if r["key"] == team]
    assert row == {"key": team, "gpu_seconds": pytest.approx(held.total_seconds() * 2, abs=0.002), "jobs": 1, "attempts": 1}
    by_user = expect(orchestrator.admin("GET", "/api/usage", params={"group_by": "user"}), 200)
    assert [r["gpu_seconds"] for r in by_user["rows"] if r["key"] == alice] == [row["gpu_seconds"]]
    metrics = expect_text(orchestrator.admin("GET", "/metrics"))
    assert f'simpletuner_gpu_seconds_total{{team="{team}",user="{alice}"}}' in metrics

    # A quota below what the team used: its next submit is refused, and no job is made.
    limits = orchestrator.admin("PUT", f"/api/admin/teams/{team}/limits", json={"gpu_hours_per_30_days": 0.0001})
    assert expect(limits, 200)["gpu_hours_per_30_days"] == 0.0001
    refused = as_alice.post(orchestrator.url("/api/queue/submit"), json={"config_name": "e2e-usage", "worker_labels": {"pool": fleet.tag}})
    assert refused.status_code == 403, refused.text
    assert refused.json()["code"] == "gpu_quota_exceeded" and f"team {team}'s quota" in refused.json()["detail"]
    assert refused.json()["frees_at"]
    # Not a member of the team: 403. With no unfinished job left, the team can be deleted.
    outsider = operator(orchestrator, f"bob-{fleet.tag}")
    assert outsider.post(orchestrator.url("/api/queue/submit"), json={"config_name": "c", "team": team}).status_code == 403
    assert orchestrator.admin("DELETE", f"/api/admin/teams/{team}").status_code == 204


def test_a_real_agent_runs_a_team_job_and_usage_counts_its_attempt(orchestrator, fleet, agents):
    """The real agent on this node (no GPU here: the attempt holds the worker's 0 GPUs, and is counted)."""
    alice, team = f"carol-{fleet.tag}", f"agents-{fleet.tag}"
    as_alice = operator(orchestrator, alice)
    expect(orchestrator.admin("POST", "/api/admin/teams", json={"name": team, "members": [alice]}), 201)
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agents.wait_ready(agents.start(worker))

    submitted = expect(
        as_alice.post(
            orchestrator.url("/api/queue/submit"),
            json={"config_name": "e2e-agent", "config": QUICK_JOB, "worker_labels": {"pool": fleet.tag}},
        ),
        201,
    )
    agents.jobs.append(submitted["job_id"])
    job = job_in(orchestrator, submitted["job_id"], "completed", "failed", "cancelled")

    assert (job["status"], job["team"], job["submitted_by"]) == ("completed", team, alice)
    gpus = worker.state()["gpu_count"]
    (attempt,) = job["attempts"]
    held = (datetime.fromisoformat(attempt["finished_at"]) - datetime.fromisoformat(attempt["started_at"])).total_seconds()
    rows = expect(orchestrator.admin("GET", "/api/usage", params={"group_by": "team"}), 200)["rows"]
    (row,) = [r for r in rows if r["key"] == team]
    assert (row["jobs"], row["attempts"]) == (1, 1)
    assert row["gpu_seconds"] == pytest.approx(held * gpus, abs=0.002)


def expect_text(response):
    assert response.status_code == 200, response.text[:500]
    return response.text
