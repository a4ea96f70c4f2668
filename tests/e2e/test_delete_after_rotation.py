"""Issue 32.9 with real processes: once a token rotation has stopped a worker's agent, the worker can be
deleted at once (before, Delete was refused for the 2.5-3 minutes the health sweep took to notice)."""

import pytest

from .agent_harness import AgentRunner, write_import_blocker
from .harness import expect, poll

pytestmark = pytest.mark.e2e

DELETED_WITHIN_S = 10  # the server closes the revoked stream at once; the health sweep would take 120 s + 60 s


@pytest.fixture
def agents(orchestrator, fleet, tmp_path):
    runner = AgentRunner(orchestrator, fleet, tmp_path, blocker_dir=write_import_blocker(tmp_path / "no-django"))
    yield runner
    runner.cleanup()


def test_a_worker_whose_rotated_token_stopped_its_agent_is_deleted_at_once(orchestrator, fleet, agents):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    agent = agents.start(worker)
    agents.wait_ready(agent)
    refused = orchestrator.admin("DELETE", f"/api/admin/workers/{worker.id}")
    assert expect(refused, 409)["detail"].endswith("(drain it and stop its agent first)")

    expect(orchestrator.admin("POST", f"/api/admin/workers/{worker.id}/token"), 200)
    assert agent.wait_exit(timeout=DELETED_WITHIN_S) == 1, agent.describe()
    assert orchestrator.worker(worker.id)["status"] == "idle"  # not yet taken offline by the health sweep

    def delete():
        response = orchestrator.admin("DELETE", f"/api/admin/workers/{worker.id}")
        return response if response.status_code != 409 else None

    deleted = poll(delete, timeout=DELETED_WITHIN_S, message="the delete to be allowed")
    assert deleted.status_code == 204, deleted.text
    assert orchestrator.admin("GET", f"/api/admin/workers/{worker.id}").status_code == 404
