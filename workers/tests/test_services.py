"""Worker services not reached through the HTTP API: creation rules, stream open/close, drain."""

from datetime import timedelta

import pytest
from django.utils import timezone

from audit import actions
from audit.services import Actor
from job_queue.models import JobAttempt, JobStatus
from job_queue.tests.factories import JobFactory, job_on_worker
from common.errors import Conflict, InvalidInput, NotFound
from workers.models import ServerPresence, Worker, WorkerStatus, WorkerType
from workers.capabilities import parse_capabilities
from workers.services import (
    worker_create,
    worker_delete,
    worker_drain,
    worker_rotate_token,
    worker_stream_closed,
)
from job_queue.agents import worker_stream_opened
from workers.streams import server_process_id
from workers.tests.factories import WorkerFactory
from workers.tests.support import audit_rows, sent_events

pytestmark = pytest.mark.django_db

ACTOR = Actor.system("test")


def _reload(obj):
    obj.refresh_from_db()
    return obj


# --- creation -----------------------------------------------------------------------------------------


def test_create_normalises_label_values_to_strings():
    worker, _ = worker_create(name=" w1 ", labels={"gpus": 8, "spot": True, "zone": "us-west"}, actor=ACTOR)

    assert worker.name == "w1"
    assert _reload(worker).labels == {"gpus": "8", "spot": "true", "zone": "us-west"}
    assert (worker.status, worker.worker_type) == (WorkerStatus.CONNECTING, WorkerType.PERSISTENT)


@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({"name": ""}, "invalid_name"),
        ({"name": "w", "worker_type": "spot"}, "invalid_worker_type"),
        ({"name": "w", "labels": "gpu=a100"}, "invalid_labels"),
        ({"name": "w", "labels": {"gpu": None}}, "invalid_labels"),
        ({"name": "w", "labels": {"gpu": ["a100"]}}, "invalid_labels"),
    ],
)
def test_create_refuses_bad_input_and_writes_nothing(kwargs, code):
    with pytest.raises(InvalidInput) as refused:
        worker_create(actor=ACTOR, **kwargs)

    assert refused.value.code == code
    assert Worker.objects.count() == 0
    assert audit_rows() == []


def test_create_refuses_a_taken_name():
    WorkerFactory(name="taken")

    with pytest.raises(Conflict):
        worker_create(name="taken", actor=ACTOR)

    assert Worker.objects.count() == 1


# --- capabilities -----------------------------------------------------------------------------------


def test_flat_fields_win_over_gpu_info():
    caps = parse_capabilities({"gpu_count": 4, "gpu_info": {"count": 2, "name": "A100"}, "gpu_name": "H100"})

    assert (caps["gpu_count"], caps["gpu_name"], caps["accelerator_type"]) == (4, "H100", "cuda")


# --- streams ------------------------------------------------------------------------------------------


def test_opening_a_stream_marks_it_and_dispatches_to_an_idle_worker(commit):
    worker = WorkerFactory(stream_id=None)
    job = JobFactory()

    with commit():
        worker_stream_opened(worker_id=worker.pk, stream_id="s-1", replaying=False)

    assert _reload(worker).stream_id == "s-1"
    assert worker.stream_opened_at is not None
    assert [(e["type"], e["data"]["job_id"]) for e in sent_events(worker.pk)] == [("job_submit", job.pk)]


def test_a_new_stream_redelivers_an_unacknowledged_dispatch_with_the_same_attempt(commit):
    worker = WorkerFactory(stream_id=None, status=WorkerStatus.BUSY)
    job = job_on_worker(worker, status=JobStatus.DISPATCHED)

    with commit():
        worker_stream_opened(worker_id=worker.pk, stream_id="s-2", replaying=False)

    (event,) = sent_events(worker.pk)
    assert event["type"] == "job_submit"
    assert (event["data"]["job_id"], event["data"]["attempt"], event["data"]["attempt_number"]) == (
        job.pk,
        job.lease_id,
        1,
    )
    assert JobAttempt.objects.filter(job=job).count() == 1
    assert _reload(job).status == JobStatus.DISPATCHED


@pytest.mark.parametrize(
    ("job_status", "replaying"),
    [(JobStatus.DISPATCHED, True), (JobStatus.RUNNING, False)],
    ids=["resumed stream replays by itself", "running job is not resent"],
)
def test_no_redelivery_when_not_needed(commit, job_status, replaying):
    worker = WorkerFactory(stream_id=None)
    job_on_worker(worker, status=job_status)

    with commit():
        worker_stream_opened(worker_id=worker.pk, stream_id="s-3", replaying=replaying)

    assert sent_events() == []


def test_closing_an_old_stream_does_not_forget_the_new_one():
    worker = WorkerFactory(stream_id="new")

    worker_stream_closed(worker_id=worker.pk, stream_id="old")
    assert _reload(worker).stream_id == "new"

    worker_stream_closed(worker_id=worker.pk, stream_id="new")
    assert _reload(worker).stream_id is None


def test_a_second_stream_of_the_same_agent_never_strands_the_worker_when_it_closes(commit):
    worker = WorkerFactory(stream_id=None)

    with commit():
        worker_stream_opened(worker_id=worker.pk, stream_id="before-cut", replaying=False, instance="i-1")
        worker_stream_opened(worker_id=worker.pk, stream_id="after-cut", replaying=False, instance="i-1")
    assert _reload(worker).stream_id == "after-cut"
    assert [entry["id"] for entry in worker.open_streams] == ["before-cut", "after-cut"]
    assert [e["type"] for e in sent_events(worker.pk)] == []  # a reconnect: nobody is told anything

    worker_stream_closed(worker_id=worker.pk, stream_id="after-cut")
    assert _reload(worker).stream_id == "before-cut"  # its earlier stream, still open, serves again
    assert [entry["id"] for entry in worker.open_streams] == ["before-cut"]

    worker_stream_closed(worker_id=worker.pk, stream_id="before-cut")
    assert _reload(worker).stream_id is None
    assert worker.open_streams == []


def test_streams_of_a_dead_server_process_are_forgotten_when_a_stream_opens(commit):
    now = timezone.now()
    ServerPresence.objects.create(pk="dead:1:aa", hostname="dead", pid=1, started_at=now, last_seen=now - timedelta(hours=1))
    ServerPresence.objects.create(pk="live:2:bb", hostname="live", pid=2, started_at=now, last_seen=now)
    worker = WorkerFactory(
        stream_id="on-live",
        open_streams=[
            {"id": "on-dead", "process": "dead:1:aa", "instance": "i-1"},
            {"id": "on-live", "process": "live:2:bb", "instance": "i-1"},
        ],
    )

    with commit():
        worker_stream_opened(worker_id=worker.pk, stream_id="here", replaying=False, instance="i-1")

    assert [entry["id"] for entry in _reload(worker).open_streams] == ["on-live", "here"]
    assert worker.open_streams[-1]["process"] == server_process_id()
    worker_stream_closed(worker_id=worker.pk, stream_id="here")
    assert _reload(worker).stream_id == "on-live"


# --- drain, rotate, delete on unknown or refused workers ------------------------------------------------


@pytest.mark.parametrize("service", [worker_drain, worker_rotate_token, worker_delete])
def test_services_on_an_unknown_worker_raise_not_found(service):
    with pytest.raises(NotFound):
        service(worker_id="w_000000000000", actor=ACTOR)

    assert audit_rows() == []


def test_drain_of_a_never_connected_worker_marks_it_draining(commit):
    worker = WorkerFactory(fresh=True)

    with commit():
        worker_drain(worker_id=worker.pk, actor=ACTOR)

    assert _reload(worker).status == WorkerStatus.DRAINING
    assert [r.action for r in audit_rows()] == [actions.WORKER_DRAIN_REQUESTED, actions.WORKER_STATUS_CHANGED]
    assert [e["type"] for e in sent_events(worker.pk)] == ["drain"]


def test_a_stopped_server_counts_as_down_and_its_streams_as_closed(commit):
    from workers.presence import server_presence_beat, server_presence_end

    now = timezone.now()
    server_presence_beat(process_id="gone:1:aa", hostname="gone", pid=1, started_at=now)
    server_presence_beat(process_id="up:2:bb", hostname="up", pid=2, started_at=now)
    worker = WorkerFactory(stream_id="old", open_streams=[{"id": "old", "process": "gone:1:aa"}])

    server_presence_end(process_id="gone:1:aa")
    with commit():
        worker_stream_opened(worker_id=worker.pk, stream_id="new", replaying=False)

    assert [entry["id"] for entry in _reload(worker).open_streams] == ["new"]
    worker_stream_closed(worker_id=worker.pk, stream_id="new")
    assert _reload(worker).stream_id is None  # not the dead server's stream
