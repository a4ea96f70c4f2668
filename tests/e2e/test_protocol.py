"""The worker protocol end to end: a real daphne orchestrator, real HTTP and real SSE streams, on each backend."""

import json

import pytest

from worker_agent import protocol

from .harness import expect, poll

pytestmark = pytest.mark.e2e

# Events the library itself sends on every stream; they carry no JSON payload.
LIBRARY_EVENTS = frozenset({"stream-open", "keep-alive"})
NEGATIVE_WINDOW_S = 1.0


def ours(event):
    return event.type not in LIBRARY_EVENTS


def channel_of(event_id):
    return event_id.rsplit(":", 1)[0]


def sequence_of(event_id):
    return int(event_id.rsplit(":", 1)[1])


def test_acceptance_flow(orchestrator, fleet):
    a100 = fleet.create_worker(labels={"gpu_type": "a100-80g", "location": "dc-a"})
    h100 = fleet.create_worker(labels={"gpu_type": "h100", "location": "dc-a"})

    # One agent speaks the spec's flat fields, the other the upstream agent's gpu_info.
    registered = a100.register(
        {
            "name": a100.name,
            "gpu_count": 2,
            "gpu_name": "NVIDIA A100-SXM4-80GB",
            "gpu_vram_gb": 80,
            "accelerator_type": "cuda",
        }
    )
    assert registered["worker_id"] == a100.id
    assert registered["status"] == "idle"
    assert registered["sse_url"].endswith(f"/api/workers/stream?worker_id={a100.id}")
    h100.register(
        {
            "name": h100.name,
            "gpu_info": {
                "name": "NVIDIA H100 80GB HBM3",
                "vram_gb": 80.0,
                "count": 8,
                "driver": "12.4",
                "accelerator": "cuda",
            },
            "persistent": True,
            "current_job_id": None,
        }
    )
    capabilities = ("status", "gpu_count", "gpu_name", "gpu_vram_gb", "accelerator_type")
    assert [a100.state()[k] for k in capabilities] == ["idle", 2, "NVIDIA A100-SXM4-80GB", 80.0, "cuda"]
    assert [h100.state()[k] for k in capabilities] == ["idle", 8, "NVIDIA H100 80GB HBM3", 80.0, "cuda"]

    a100_stream = fleet.open_stream(a100)
    h100_stream = fleet.open_stream(h100)

    config = {"model_family": "flux", "learning_rate": 0.0001, "max_train_steps": 10}
    dataloader = [{"id": "e2e-images", "type": "local", "instance_data_dir": "/data/e2e"}]
    submitted = fleet.submit(
        {
            "config_name": "e2e-acceptance",
            "config": config,
            "dataloader": dataloader,
            "target": "worker",
            "worker_labels": {"gpu_type": "a100*"},
        }
    )
    assert submitted["dispatched"] is True
    assert submitted["status"] == "dispatched"
    assert submitted["worker_id"] == a100.id
    job_id = submitted["job_id"]

    event = a100_stream.wait_for("job_submit")
    data = event.json()
    assert data["type"] == "job_submit"
    assert data["job_id"] == job_id
    assert data["config"] == config
    assert data["config_name"] == "e2e-acceptance"
    assert data["dataloader"] == dataloader
    assert isinstance(data["upload_endpoint"], str) and data["upload_endpoint"]
    attempt = data["attempt"]
    assert isinstance(attempt, str) and attempt
    assert channel_of(event.id) == f"worker-{a100.id}"
    # The first worker has its event: the other one, watched a while longer, gets nothing.
    h100_stream.assert_no_event(within=NEGATIVE_WINDOW_S, where=ours)

    for reported, expected in (("starting", "running"), ("running", "running"), ("completed", "completed")):
        answer = a100.report(job_id, reported, attempt=attempt)
        assert answer == {"job_id": job_id, "status": expected, "accepted": True}
        assert orchestrator.job(job_id)["status"] == expected

    job = orchestrator.job(job_id)
    assert job["status"] == "completed"
    assert job["worker_id"] == a100.id
    assert job["progress"]["fraction"] == 1.0
    assert [(a["lease_id"], a["outcome"]) for a in job["attempts"]] == [(attempt, "completed")]
    worker = a100.state()
    assert (worker["status"], worker["current_job_id"]) == ("idle", None)
    assert h100.state()["status"] == "idle"

    audit = orchestrator.audit(target_id=job_id)
    actions = {row["action"] for row in audit}
    assert {"job.submitted", "job.dispatched", "job.status_changed"} <= actions
    dispatched = [row for row in audit if row["action"] == "job.dispatched"]
    assert [row["details"]["worker"] for row in dispatched] == [a100.id]
    changes = {(row["details"]["from"], row["details"]["to"]) for row in audit if row["action"] == "job.status_changed"}
    assert changes == {("queued", "dispatched"), ("dispatched", "running"), ("running", "completed")}


def test_drain_is_durable(orchestrator, fleet):
    pool = {"pool": fleet.tag}
    worker = fleet.create_worker(labels={"gpu_type": "l40s", **pool})
    worker.register()
    stream = fleet.open_stream(worker)

    drained = expect(orchestrator.admin("POST", f"/api/admin/workers/{worker.id}/drain"), 200)
    assert (drained["status"], drained["draining"]) == ("draining", True)
    event = stream.wait_for("drain")
    assert event.json()["type"] == "drain"

    beat = worker.heartbeat({"worker_id": worker.id, "status": "idle", "current_job_id": None})
    assert (beat["status"], beat["draining"]) == ("draining", True)
    assert worker.state()["status"] == "draining"

    again = worker.register({"name": worker.name, "gpu_count": 1, "current_job_id": None})
    assert (again["status"], again["draining"]) == ("draining", True)
    assert worker.state()["status"] == "draining"

    submitted = fleet.submit({"config_name": "e2e-drain", "worker_labels": pool})
    assert submitted["dispatched"] is False
    assert submitted["status"] == "queued"
    assert "draining" in submitted["waiting_reason"]
    stream.assert_no_event("job_submit", within=NEGATIVE_WINDOW_S)
    job = orchestrator.job(submitted["job_id"])
    assert job["status"] == "queued" and "draining" in job["waiting_reason"]
    assert worker.state()["status"] == "draining"
    expect(orchestrator.admin("POST", f"/api/queue/{submitted['job_id']}/cancel"), 200)


def test_token_rotation_closes_stream_and_refuses_old_token(orchestrator, fleet):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    worker.register()
    old_token = worker.token
    stream = fleet.open_stream(worker)

    rotated = expect(orchestrator.admin("POST", f"/api/admin/workers/{worker.id}/token"), 200)
    new_token = rotated["token"]
    assert rotated["worker_id"] == worker.id
    assert new_token.startswith("wt_") and new_token != old_token

    assert stream.wait_closed() == "server closed the stream"
    assert not stream.received("job_submit")
    # The stream ends with a typed event the agent understands, not the library's untyped error.
    assert [e.json() for e in stream.received("shutdown")] == [{"type": "shutdown", "reason": "token rotated", "code": "token_revoked"}]
    assert not stream.received("stream-error")

    for method, path, body in (
        ("POST", "/api/workers/heartbeat", {"worker_id": worker.id, "status": "idle", "current_job_id": None}),
        ("POST", "/api/workers/register", {"name": worker.name}),
    ):
        refused = expect(orchestrator.as_worker(old_token, method, path, json=body), 401)
        assert refused["code"] == "not_authenticated"
    refused_stream = orchestrator.stream(old_token)
    assert refused_stream.status_code == 401
    assert json.loads(refused_stream.body)["code"] == "not_authenticated"

    worker.token = new_token
    assert worker.register()["status"] == "idle"
    fleet.open_stream(worker)
    assert worker.heartbeat()["status"] == "idle"
    rotations = orchestrator.audit(target_id=worker.id, action="worker.token_rotated")
    assert len(rotations) == 1


def test_delete_refused_while_online(orchestrator, fleet):
    worker = fleet.create_worker(labels={"pool": fleet.tag})
    worker.register()
    stream = fleet.open_stream(worker)

    response = orchestrator.admin("DELETE", f"/api/admin/workers/{worker.id}")
    assert response.headers["Content-Type"].startswith("application/json")
    assert expect(response, 409)["code"] == "worker_online"
    assert worker.state()["status"] == "idle"

    assert worker.disconnect() == {"status": "offline"}
    assert worker.state()["status"] == "offline"
    expect(orchestrator.admin("DELETE", f"/api/admin/workers/{worker.id}"), 204)
    assert expect(orchestrator.admin("GET", f"/api/admin/workers/{worker.id}"), 404)["code"] == "not_found"
    # The deleted worker's token and stream die with it.
    assert stream.wait_closed() == "server closed the stream"
    worker.heartbeat(status=401)

    never_connected = fleet.create_worker(labels={"pool": fleet.tag})
    expect(orchestrator.admin("DELETE", f"/api/admin/workers/{never_connected.id}"), 204)


def test_stream_authentication_and_isolation(orchestrator, fleet):
    pool = {"pool": fleet.tag}
    mine, other = fleet.create_worker(labels=pool), fleet.create_worker(labels=pool)
    mine.register()
    other.register()

    for token in (None, "wt_" + "x" * 43, other.token[:-2]):
        refused = orchestrator.stream(token)
        assert refused.status_code == 401, f"token {token!r}: HTTP {refused.status_code}"
        assert refused.response.headers["Content-Type"].startswith("application/json")
        assert json.loads(refused.body)["code"] == "not_authenticated"

    impersonating = orchestrator.stream(mine.token, params={"worker_id": other.id})
    assert impersonating.status_code == 403
    assert json.loads(impersonating.body)["code"] == "permission_denied"

    other_stream = fleet.open_stream(other)
    expect(orchestrator.admin("POST", f"/api/admin/workers/{other.id}/drain"), 200)
    other_drain = other_stream.wait_for("drain")
    assert channel_of(other_drain.id) == f"worker-{other.id}"

    # Asking for the other worker's channel, and to resume it from the start, yields only our own events.
    snooping = fleet.open_stream(
        mine, params={"channel": f"worker-{other.id}"}, last_event_id=f"worker-{other.id}:0"
    )
    expect(orchestrator.admin("POST", f"/api/admin/workers/{mine.id}/drain"), 200)
    own_drain = snooping.wait_for("drain")
    assert channel_of(own_drain.id) == f"worker-{mine.id}"
    snooping.assert_no_event(within=NEGATIVE_WINDOW_S, where=lambda e: ours(e) and e is not own_drain)
    assert {channel_of(e.id) for e in snooping.received() if e.id} == {f"worker-{mine.id}"}


def test_dispatch_at_connect_and_replay_after_reconnect(orchestrator, fleet):
    pool = {"pool": fleet.tag}
    worker = fleet.create_worker(labels=pool)
    worker.register()

    # Registered but no stream yet: the job waits; opening the stream dispatches it onto that stream.
    submitted = fleet.submit({"config_name": "e2e-connect", "worker_labels": pool})
    job_id = submitted["job_id"]
    assert submitted["dispatched"] is False and submitted["status"] == "queued"
    stream = fleet.open_stream(worker, wait_open=False)
    delivered = stream.wait_for("job_submit")
    assert delivered.json()["job_id"] == job_id
    assert orchestrator.job(job_id)["status"] == "dispatched"
    last_seen = stream.last_event_id
    assert channel_of(last_seen) == f"worker-{worker.id}"

    stream.close()
    poll(lambda: not worker.state()["stream_connected"], timeout=10, message="the server to notice the closed stream")

    # While the stream is down: the job is cancelled and the worker drained.
    assert expect(orchestrator.admin("POST", f"/api/queue/{job_id}/cancel"), 200)["status"] == "cancelled"
    expect(orchestrator.admin("POST", f"/api/admin/workers/{worker.id}/drain"), 200)

    resumed = fleet.open_stream(worker, last_event_id=last_seen, wait_open=False)
    cancel = resumed.wait_for("job_cancel")
    drain = resumed.wait_for("drain")
    assert cancel.json()["job_id"] == job_id
    assert sequence_of(last_seen) < sequence_of(cancel.id) < sequence_of(drain.id)
    resumed.assert_no_event("job_submit", within=NEGATIVE_WINDOW_S)
    assert [e.type for e in resumed.received() if ours(e)] == ["job_cancel", "drain"]


def test_upstream_agent_wire_protocol(orchestrator, fleet):
    pool = {"pool": fleet.tag}
    worker = fleet.create_worker(labels=pool, worker_type="ephemeral")
    gpu_info = {"name": "NVIDIA A100-SXM4-80GB", "vram_gb": 80.0, "count": 2, "driver": "12.4", "accelerator": "cuda"}

    registered = worker.register(
        {"name": worker.name, "gpu_info": gpu_info, "persistent": False, "current_job_id": None}
    )
    assert registered["worker_id"] == worker.id
    assert "resume_job" not in registered and "abandon_job" not in registered
    assert worker.state()["gpu_count"] == 2

    stream = fleet.open_stream(worker, params={"worker_id": worker.id})
    config = {"model_family": "sdxl", "max_train_steps": 5}
    first = fleet.submit({"config_name": "e2e-upstream", "config": config, "worker_labels": pool})
    assert first["dispatched"] is True
    job_id = first["job_id"]
    submit = stream.wait_for("job_submit").json()
    assert (submit["job_id"], submit["config"], submit["dataloader"]) == (job_id, config, None)
    assert isinstance(submit["upload_endpoint"], str)

    assert worker.heartbeat({"worker_id": worker.id, "status": "busy", "current_job_id": job_id})["status"] == "busy"
    assert worker.report(job_id, "starting", error=None)["status"] == "running"
    # The agent restarts mid-job and reports the job it still runs: it is told to carry on.
    again = worker.register({"name": worker.name, "gpu_info": gpu_info, "persistent": False, "current_job_id": job_id})
    assert again["resume_job"]["job_id"] == job_id and "abandon_job" not in again
    assert worker.report(job_id, "training", error=None, progress=0.5)["status"] == "running"
    assert worker.report(job_id, "completed", error=None)["status"] == "completed"
    assert worker.heartbeat({"worker_id": worker.id, "status": "idle", "current_job_id": None})["status"] == "idle"
    assert expect(worker.call("GET", "/api/workers/queue", params={"worker_id": worker.id}), 200) == {"has_jobs": False}

    second = fleet.submit({"config_name": "e2e-upstream-cancel", "worker_labels": pool})
    second_id = second["job_id"]
    stream.wait_for("job_submit", where=lambda e: e.json()["job_id"] == second_id)
    expect(orchestrator.admin("POST", f"/api/queue/{second_id}/cancel"), 200)
    assert stream.wait_for("job_cancel").json()["job_id"] == second_id
    assert worker.report(second_id, "cancelled", error=None)["status"] == "cancelled"
    assert worker.state()["status"] == "idle"

    assert worker.disconnect() == {"status": "offline"}
    assert worker.state()["status"] == "offline"
    stream.close()

    # What the upstream agent reads: every "data: " line is a JSON object with a type.
    data_lines = [line for line in stream.lines if line.startswith("data: ")]
    assert len(data_lines) >= 3
    for line in data_lines:
        payload = json.loads(line[len("data: ") :])
        assert isinstance(payload, dict) and isinstance(payload.get("type"), str), line
    for event in stream.received():
        if ours(event):
            assert event.json()["type"] == event.type
        else:
            assert event.data == ""
    assert [e.type for e in stream.received() if ours(e)] == ["job_submit", "job_submit", "job_cancel"]


def test_a_stream_refused_or_with_the_librarys_own_parameters_never_leaves_a_phantom(orchestrator, fleet):
    """The library's own stream parameters (signed metadata, GRIP recovery, paging, channel choice) are
    ignored, never a 500; a stream refused for a bad Last-Event-ID changes nothing, so the worker's
    open stream keeps receiving its jobs; a stream that closes is never left counted as open."""
    pool = {"pool": fleet.tag}
    worker = fleet.create_worker(labels=pool)
    worker.register()

    for params in ({"es-meta": "x"}, {"recover": "true"}, {"link": "next"}, {"channels": "worker-w_0"}):
        odd = fleet.open_stream(worker, params=params)
        assert worker.state()["stream_connected"] is True, params
        odd.close()
        poll(lambda: not worker.state()["stream_connected"], timeout=10, message=f"the stream with {params} to count as closed")

    first = fleet.open_stream(worker)
    for bad in ("error", "garbage", "a:b:c"):
        refused = orchestrator.stream(worker.token, last_event_id=bad)
        assert refused.status_code == 400, f"Last-Event-ID {bad!r}: HTTP {refused.status_code}"
        assert json.loads(refused.body)["code"] == "invalid_last_event_id"
    assert worker.state()["stream_connected"] is True
    job_id = fleet.submit({"config_name": "e2e-phantom", "worker_labels": pool})["job_id"]
    assert first.wait_for("job_submit").json()["job_id"] == job_id


def test_a_second_stream_on_a_workers_token_takes_over_and_jobs_reach_it_alone(orchestrator, fleet):
    """A second stream with a worker's token (a curl, or SimpleTuner's released agent, which sends no instance):
    the newest serves. The first is told who took over and ends; the job goes to the second alone; when the
    second closes, the worker has no stream and gets no job (issue 32, item 6; it was issue 14.1's "both")."""
    pool = {"pool": fleet.tag}
    worker = fleet.create_worker(labels=pool)
    worker.register({"name": worker.name, "hostname": "node-1"})
    first = fleet.open_stream(worker)
    assert worker.state()["open_streams"] == 1
    worker.register({"name": "curl-beside", "hostname": "laptop"})
    second = fleet.open_stream(worker)

    told = first.wait_for(protocol.SHUTDOWN).json()
    assert (told["code"], told["agent_name"], told["agent_host"]) == (protocol.AGENT_REPLACED, "curl-beside", "laptop")
    first.wait_closed()
    state = worker.state()
    assert (state["open_streams"], state["serving_agent"]) == (1, {"name": "curl-beside", "host": "laptop", "instance": None})

    submitted = fleet.submit({"config_name": "e2e-two-streams", "worker_labels": pool})
    assert submitted["dispatched"] is True
    delivered = second.wait_for("job_submit").json()
    assert delivered["job_id"] == submitted["job_id"] and not any(key.startswith("_") for key in delivered)
    assert [e.type for e in first.received() if e.type == "job_submit"] == []
    second.assert_no_event(protocol.SHUTDOWN, within=0.5)
    expect(orchestrator.admin("POST", f"/api/queue/{submitted['job_id']}/cancel"), 200)
