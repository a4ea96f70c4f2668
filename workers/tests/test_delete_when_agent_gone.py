"""Deleting a worker whose agent is gone (issue 32.9): after a token rotation stopped its agent the worker
can be deleted at once; a worker whose stream closed without that is refused with the wait the health
sweep takes, and one whose agent holds a token in use is refused as before."""

from datetime import timedelta

import pytest
from django.utils import timezone

from audit import actions
from audit.services import Actor
from common.errors import Conflict
from job_queue.tests.factories import JobFactory
from workers.models import Token, Worker, WorkerStatus
from workers.services import (
    token_authenticate,
    worker_delete,
    worker_delete_refusal,
    worker_rotate_token,
    worker_stream_closed,
)
from workers.tests.factories import WorkerFactory, worker_token
from workers.tests.support import audit_rows

pytestmark = pytest.mark.django_db

ACTOR = Actor.system("test")


def _used(plaintext):
    assert token_authenticate(kind="worker", plaintext=plaintext) is not None  # as the agent's calls do


def _rotated_and_stream_closed(worker):
    _used(worker_token(worker))
    new_plaintext = worker_rotate_token(worker_id=worker.pk, actor=ACTOR)
    worker_stream_closed(worker_id=worker.pk, stream_id=worker.stream_id)  # the revocation closed its stream
    return Worker.objects.get(pk=worker.pk), new_plaintext


def test_a_worker_whose_rotation_stopped_its_agent_is_deleted_at_once():
    worker, _ = _rotated_and_stream_closed(WorkerFactory())
    assert worker.status == WorkerStatus.IDLE  # the health sweep has not run: still online

    assert worker_delete_refusal(worker) is None
    worker_delete(worker_id=worker.pk, actor=ACTOR)

    assert not Worker.objects.filter(pk=worker.pk).exists()
    assert [row.target_id for row in audit_rows(actions.WORKER_DELETED)] == [worker.pk]


def test_once_an_agent_uses_the_new_token_the_worker_is_its_agents_again():
    worker, new_plaintext = _rotated_and_stream_closed(WorkerFactory())
    _used(new_plaintext)  # a restarted agent registered with it

    with pytest.raises(Conflict) as refused:
        worker_delete(worker_id=worker.pk, actor=ACTOR)
    assert refused.value.code == "worker_online"
    assert Worker.objects.filter(pk=worker.pk).exists()


def test_a_connected_agent_is_told_to_stop_first():
    worker = WorkerFactory()
    _used(worker_token(worker))
    assert worker_delete_refusal(worker) == (
        f"worker {worker.name} is idle; only an offline worker can be deleted (drain it and stop its agent first)"
    )


def test_a_worker_with_no_token_rotated_is_its_agents():
    worker = WorkerFactory(stream_id=None)  # its agent's stream dropped; its token is still good
    worker_token(worker)
    assert worker_delete_refusal(worker).startswith(f"worker {worker.name} is idle; only an offline worker can be deleted.")


def test_a_rotation_lets_the_worker_go_even_before_its_old_stream_is_seen_closed():
    worker = WorkerFactory()
    _used(worker_token(worker))
    worker_rotate_token(worker_id=worker.pk, actor=ACTOR)  # its stream closes on commit; the row may lag

    assert worker_delete_refusal(Worker.objects.get(pk=worker.pk)) is None


def test_a_closed_stream_with_a_live_token_says_how_long_until_it_may_be_deleted(settings):
    settings.SIMPLETUNER = {**settings.SIMPLETUNER, "HEARTBEAT_TIMEOUT": 120, "HEALTH_CHECK_INTERVAL": 60}
    now = timezone.now().replace(microsecond=0)
    worker = WorkerFactory(stream_id=None, last_heartbeat=now - timedelta(seconds=30))
    _used(worker_token(worker))  # the agent died holding its token: it could come back with it

    refusal = worker_delete_refusal(worker, now=now)

    offline_by = now + timedelta(seconds=150)
    assert refusal == (
        f"worker {worker.name} is idle; only an offline worker can be deleted. Its agent has no stream open: the health "
        f"sweep takes the worker offline 120 s after its last heartbeat, within about 150 s (by {offline_by:%H:%M:%S} UTC); "
        "delete it then, or rotate its token to delete it at once (a rotated token's agent is refused)"
    )
    worker_rotate_token(worker_id=worker.pk, actor=ACTOR)  # as the refusal says
    assert worker_delete_refusal(Worker.objects.get(pk=worker.pk)) is None


def test_a_gone_agents_worker_with_a_job_waits_for_the_sweep_to_release_it():
    worker, _ = _rotated_and_stream_closed(WorkerFactory())
    Worker.objects.filter(pk=worker.pk).update(status=WorkerStatus.BUSY)
    job = JobFactory(status="running", worker=Worker.objects.get(pk=worker.pk))
    Worker.objects.filter(pk=worker.pk).update(current_job=job)

    refusal = worker_delete_refusal(Worker.objects.get(pk=worker.pk))

    assert refusal.startswith(f"worker {worker.name} is busy; only an offline worker can be deleted. Its agent has no stream open")
    assert Token.objects.filter(worker=worker).exists()
