"""One agent serves a worker: another agent on its token takes it over, the agent before is told, and a
job_submit is delivered by the streams of the agent it was dispatched to only (issue 32, item 6)."""

import json

import pytest

from audit import actions
from audit.services import Actor
from common.errors import InvalidInput
from job_queue.agents import worker_register, worker_stream_opened
from job_queue.takeover import agent_instance
from job_queue.dispatch import REPLACED_STREAMS, TO_AGENT
from job_queue.models import Job, JobStatus
from job_queue.tests.factories import JobFactory
from realtime.streams import fence
from worker_agent import protocol
from workers.models import Worker
from workers.streams import serving_entry
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows, sent_events

pytestmark = pytest.mark.django_db

ACTOR = Actor.system("test")


def _reload(worker):
    return Worker.objects.get(pk=worker.pk)


def _open(worker, stream_id, instance, *, name="gpu-a", host="host-a"):
    """The agent ``name`` on ``host`` registered (as it always does first), then opened stream ``stream_id``."""
    Worker.objects.filter(pk=worker.pk).update(agent_name=name, hostname=host)
    worker_stream_opened(worker_id=worker.pk, stream_id=stream_id, replaying=False, instance=instance)


def _register(worker, instance, *, name="gpu-b", host="host-b"):
    return worker_register(worker_id=worker.pk, data={"name": name, "hostname": host}, actor=ACTOR, instance=instance)


def _shutdowns(worker):
    return [e["data"] for e in sent_events(worker.pk) if e["type"] == protocol.SHUTDOWN]


def _submits(worker):
    return [e["data"] for e in sent_events(worker.pk) if e["type"] == protocol.JOB_SUBMIT]


def test_the_stream_of_another_agent_takes_the_worker_over_and_the_agent_before_is_told(commit):
    worker = WorkerFactory(stream_id=None)
    with commit():
        _open(worker, "stream-a", "i-a")
        _open(worker, "stream-b", "i-b", name="gpu-b", host="host-b")

    worker = _reload(worker)
    assert worker.stream_id == "stream-b" and [e["id"] for e in worker.open_streams] == ["stream-b"]
    assert serving_entry(worker) | {"process": None} == {
        "id": "stream-b", "process": None, "instance": "i-b", "name": "gpu-b", "host": "host-b"
    }
    (told,) = _shutdowns(worker)
    assert told["code"] == protocol.AGENT_REPLACED and told[REPLACED_STREAMS] == ["stream-a"]
    assert (told["agent_name"], told["agent_host"]) == ("gpu-b", "host-b")
    assert "gpu-b on host-b" in told["reason"]
    (row,) = [r for r in audit_rows() if r.action == actions.WORKER_AGENT_REPLACED]
    assert row.details == {"by": {"name": "gpu-b", "host": "host-b"}, "replaced": [{"name": "gpu-a", "host": "host-a", "instance": "i-a"}]}


def test_a_job_is_dispatched_to_the_agent_whose_stream_serves(commit):
    worker = WorkerFactory(stream_id=None)
    with commit():
        _open(worker, "stream-a", "i-a")
    job = JobFactory()
    with commit():
        _open(worker, "stream-b", None)  # SimpleTuner's released agent: no instance, the newest stream wins
    (submit,) = _submits(worker)
    assert (submit["job_id"], submit[TO_AGENT]) == (job.pk, "s:stream-b")
    assert Job.objects.get(pk=job.pk).status == JobStatus.DISPATCHED


def test_the_registration_of_another_agent_fences_the_worker_until_its_own_stream_opens(commit):
    worker = WorkerFactory(stream_id=None)
    with commit():
        _open(worker, "stream-a", "i-a")
    with commit():
        _register(worker, "i-b")
    job = JobFactory()
    from job_queue.dispatch import dispatch_for_job

    assert dispatch_for_job(job.pk) is None  # no job for the agent before, nor for one without a stream
    worker = _reload(worker)
    assert (worker.stream_id, worker.open_streams) == (None, [])
    (told,) = _shutdowns(worker)
    assert told[REPLACED_STREAMS] == ["stream-a"] and told["agent_name"] == "gpu-b"

    with commit():
        worker_stream_opened(worker_id=worker.pk, stream_id="stream-b", replaying=False, instance="i-b")
    (submit,) = _submits(worker)
    assert (submit["job_id"], submit[TO_AGENT]) == (job.pk, "i:i-b")
    assert len(_shutdowns(worker)) == 1  # its own stream replaces nobody


@pytest.mark.parametrize(("serving", "registering"), [("i-a", "i-a"), (None, None)], ids=["same instance", "neither says"])
def test_a_registration_that_may_be_the_serving_agents_own_keeps_its_stream(commit, serving, registering):
    worker = WorkerFactory(stream_id=None)
    with commit():
        _open(worker, "stream-a", serving)
        _register(worker, registering)
    assert _reload(worker).stream_id == "stream-a"
    assert _shutdowns(worker) == []


def test_an_agent_instance_must_be_a_short_plain_word():
    assert agent_instance("") is None and agent_instance(None) is None
    assert agent_instance("0f3a-b_9") == "0f3a-b_9"
    for bad in ("a b", "x" * 65, "é", "a\n"):
        with pytest.raises(InvalidInput) as refused:
            agent_instance(bad)
        assert refused.value.code == "invalid_agent_instance"


# --- the fence: what each stream delivers of the worker's one channel ---------------------------------


def _event(kind, data, event_id):
    return f"event: {kind}\nid: worker-w_1:{event_id}\ndata: {json.dumps(data)}\n\n"


def test_a_job_submit_is_delivered_by_the_streams_of_its_agent_alone_without_the_servers_field():
    submit = {"type": "job_submit", "job_id": "j_1", TO_AGENT: "i:a"}
    chunk = "event: keep-alive\ndata:\n\n" + _event("job_submit", submit, 5)

    mine, ended = fence(chunk, "stream-1", "i:a")
    assert not ended and mine.startswith("event: keep-alive\ndata:\n\n")
    assert mine.endswith('event: job_submit\nid: worker-w_1:5\ndata: {"type": "job_submit", "job_id": "j_1"}\n\n')
    assert fence(chunk, "stream-2", "i:b") == ("event: keep-alive\ndata:\n\n", False)
    unaddressed = _event("job_submit", {"type": "job_submit", "job_id": "j_2"}, 6)  # stored before this version
    assert fence(unaddressed, "stream-2", "i:b") == (unaddressed, False)


def test_a_takeover_is_delivered_by_the_streams_it_ends_alone_and_ends_them():
    told = {"type": "shutdown", "code": protocol.AGENT_REPLACED, "reason": "r", "agent_name": "b", "agent_host": "h",
            REPLACED_STREAMS: ["stream-1"]}
    later = _event("job_submit", {"type": "job_submit", "job_id": "j_1"}, 8)
    chunk = _event("shutdown", told, 7) + later

    replaced, ended = fence(chunk, "stream-1", "i:a")
    assert ended and json.loads(replaced.split("data: ")[1]) == {k: v for k, v in told.items() if k != REPLACED_STREAMS}
    assert "job_submit" not in replaced  # nothing after it
    assert fence(chunk, "stream-2", "i:b") == (later, False)


def test_a_job_dispatched_to_the_agent_before_a_takeover_goes_out_again_to_the_new_one(commit):
    """Released agents (no instance): the second registers, a job goes to the first's stream (the newest yet) and
    is acknowledged; when the second's stream opens, that attempt is taken back (no retry spent) and the job
    is dispatched anew to the second, whose stream alone delivers it."""
    from job_queue.dispatch import dispatch_for_job
    from job_queue.transitions import jobs_acknowledge

    worker = WorkerFactory(stream_id=None)
    with commit():
        _open(worker, "stream-a", None)
        _register(worker, None)
    job = JobFactory()
    with commit():
        dispatch_for_job(job.pk)
        jobs_acknowledge(jobs=[Job.objects.get(pk=job.pk)], actor=ACTOR, reason="starting")
    first = Job.objects.get(pk=job.pk)
    assert (first.status, _submits(worker)[-1][TO_AGENT]) == (JobStatus.RUNNING, "s:stream-a")

    with commit():
        _open(worker, "stream-b", None, name="gpu-b", host="host-b")

    again = Job.objects.get(pk=job.pk)
    assert (again.status, again.attempt_count, again.retry_count) == (JobStatus.DISPATCHED, 2, 0)
    assert again.lease_id != first.lease_id
    submit = _submits(worker)[-1]
    assert (submit["attempt"], submit[TO_AGENT]) == (again.lease_id, "s:stream-b")
    assert _shutdowns(worker)[-1][REPLACED_STREAMS] == ["stream-a"]


def test_the_worker_page_and_api_show_the_agent_that_serves(commit, admin_client):
    from workers.tests.support import admin_url

    worker = WorkerFactory(stream_id=None)
    with commit():
        _open(worker, "stream-a", "i-aaaaaaaaaaaaaaaa")
        _open(worker, "stream-b", "i-bbbbbbbbbbbbbbbb", name="gpu-b", host="host-b")

    html = admin_client.get(admin_url(worker)).content.decode()
    assert "Serving agent" in html and "gpu-b on host-b · instance i-bbbbbbbbbb" in html
    assert "worker.agent_replaced" in html  # its audit trail says who was replaced
    detail = admin_client.get(f"/api/admin/workers/{worker.pk}").json()
    assert detail["serving_agent"] == {"name": "gpu-b", "host": "host-b", "instance": "i-bbbbbbbbbbbbbbbb"}
    assert detail["open_streams"] == 1


def test_an_agent_taken_over_while_its_link_was_cut_is_refused_when_it_comes_back(commit, worker_client):
    """A was replaced by B while A's link was cut (A never read its shutdown): A's registration is refused
    (409 agent_replaced, naming B), changing nothing; B keeps the worker."""
    from common.errors import Conflict

    worker = WorkerFactory(stream_id=None)
    with commit():
        _open(worker, "stream-a", "i-a")
        _register(worker, "i-b")
        worker_stream_opened(worker_id=worker.pk, stream_id="stream-b", replaying=False, instance="i-b")
    assert _reload(worker).replaced_instances == ["i-a"]
    before = len(audit_rows())

    with pytest.raises(Conflict) as refused:
        _register(worker, "i-a", name="gpu-a", host="host-a")
    assert refused.value.code == protocol.AGENT_REPLACED
    assert "(gpu-b on host-b); this agent stops" in refused.value.detail
    worker = _reload(worker)
    assert (worker.stream_id, worker.hostname, len(audit_rows())) == ("stream-b", "host-b", before)

    response = worker_client(worker).post(
        protocol.REGISTER_PATH, {"name": "gpu-a"}, format="json", headers={protocol.AGENT_INSTANCE_HEADER: "i-a"}
    )
    assert (response.status_code, response.json()["code"]) == (409, protocol.AGENT_REPLACED)
    assert response.json()["agent_host"] == "host-b"
    fresh = worker_client(worker).post(
        protocol.REGISTER_PATH, {"name": "gpu-c"}, format="json", headers={protocol.AGENT_INSTANCE_HEADER: "i-c"}
    )
    assert fresh.status_code == 200  # a new agent (a restart) may take the worker over


def test_an_agent_whose_stream_had_closed_is_refused_too_once_another_registered(commit):
    """The server noticed A's cut link (its stream closed) before B registered: B takes nothing from a stream, but
    A is still the agent before; when A comes back it is refused, and B keeps the worker."""
    from common.errors import Conflict

    worker = WorkerFactory(stream_id=None)
    with commit():
        _register(worker, "i-a", name="gpu-a", host="host-a")
        _register(worker, "i-a", name="gpu-a", host="host-a")  # the same agent again: nothing replaced
    assert _reload(worker).replaced_instances == []
    with commit():
        _register(worker, "i-b")
    assert (_reload(worker).agent_instance, _reload(worker).replaced_instances) == ("i-b", ["i-a"])
    with pytest.raises(Conflict):
        _register(worker, "i-a", name="gpu-a", host="host-a")
    assert _reload(worker).agent_instance == "i-b"
