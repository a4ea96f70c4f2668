"""Two agents' streams on one worker token, through the ASGI application (the lean path and Django's view):
the newer agent's stream serves and gets the job; the older is told who took over, and ends."""

import json

import pytest
from asgiref.sync import async_to_sync, sync_to_async

from job_queue.dispatch import dispatch_for_job
from job_queue.tests.factories import JobFactory
from serving.asgi import StreamASGIHandler
from simpletuner_site.asgi import application
from simpletuner_site.tests.asgi_support import rest_of_body
from worker_agent import protocol
from workers.models import Worker
from workers.tests.factories import WorkerFactory, worker_token

from .test_streams import TOKEN, _hang_up, _open, scope_of, stream_state

pytestmark = pytest.mark.django_db(transaction=True)

INSTANCE = protocol.AGENT_INSTANCE_HEADER.lower().encode()


async def _until(comm, needle):
    """Read ``comm``'s body until it holds ``needle``; return the text."""
    out = b""
    while needle not in out:
        message = await comm.receive_output(10)
        out += message.get("body", b"")
        assert message.get("more_body"), f"the stream ended without {needle!r}: {out[-500:]!r}"
    return out.decode()


@pytest.mark.parametrize("path", ["lean", "view"])
def test_a_second_agent_on_one_token_gets_the_job_and_the_first_is_told_and_ends(path):
    worker = WorkerFactory(stream_id=None, agent_name="gpu-a", hostname="host-a")
    token = worker_token(worker).encode()
    app = application if path == "lean" else StreamASGIHandler()

    def scope(instance):
        return scope_of(headers=[(TOKEN, token), (INSTANCE, instance)])

    async def run():
        first, start, _ = await _open(app, scope(b"i-a"))
        assert start["status"] == 200
        await sync_to_async(Worker.objects.filter(pk=worker.pk).update)(agent_name="gpu-b", hostname="host-b")
        second, start, _ = await _open(app, scope(b"i-b"))
        assert start["status"] == 200
        told = (await rest_of_body(first)).decode()  # ends after the shutdown
        await first.wait(10)
        job = await sync_to_async(JobFactory)()
        assert (await sync_to_async(dispatch_for_job)(job.pk)).pk == worker.pk
        got = await _until(second, b"event: job_submit")
        await _hang_up(second)
        return told, got, job.pk

    told, got, job_id = async_to_sync(run)()

    event = json.loads(told.split(f"event: {protocol.SHUTDOWN}\n", 1)[1].split("data: ", 1)[1].split("\n", 1)[0])
    assert (event["code"], event["agent_name"], event["agent_host"]) == (protocol.AGENT_REPLACED, "gpu-b", "host-b")
    assert set(event) == {"type", "code", "reason", "agent_name", "agent_host"}  # the server's own fields stay home
    assert "job_submit" not in told
    submit = json.loads(got.split(f"event: {protocol.JOB_SUBMIT}\n", 1)[1].split("data: ", 1)[1].split("\n", 1)[0])
    assert submit["job_id"] == job_id and not any(key.startswith("_") for key in submit)
    assert stream_state(worker) == (None, 0)


def test_a_reconnect_of_the_same_agent_is_no_takeover():
    worker = WorkerFactory(stream_id=None)
    token = worker_token(worker).encode()
    scope = scope_of(headers=[(TOKEN, token), (INSTANCE, b"i-a")])

    async def run():
        before, _, _ = await _open(application, scope)  # a connection the agent lost, not yet noticed here
        after, _, _ = await _open(application, scope)
        job = await sync_to_async(JobFactory)()
        await sync_to_async(dispatch_for_job)(job.pk)
        got = await _until(after, b"event: job_submit")
        also = await _until(before, b"event: job_submit")  # the same agent's: it may still read it
        for comm in (before, after):
            await _hang_up(comm)
        return got, also

    got, also = async_to_sync(run)()
    assert protocol.SHUTDOWN not in got + also


def test_a_malformed_agent_instance_is_refused_by_the_view():
    worker = WorkerFactory(stream_id=None)
    scope = scope_of(headers=[(TOKEN, worker_token(worker).encode()), (INSTANCE, b"not one word")])

    async def run():
        comm, start, _ = await _open(application, scope)
        body = await rest_of_body(comm)
        return start["status"], json.loads(body)

    status, body = async_to_sync(run)()
    assert (status, body["code"]) == (400, "invalid_agent_instance")
    assert stream_state(worker) == (None, 0)
