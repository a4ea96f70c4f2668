"""worker_provision_local: the built-in local worker is created once and keeps its token across restarts."""

import pytest
from django.utils import timezone

from audit import actions
from audit.services import Actor
from common.errors import Conflict, InvalidInput
from realtime import publish
from workers.models import Token, TokenKind, Worker, WorkerStatus, WorkerType
from workers.services import token_authenticate, worker_provision_local, worker_rotate_token
from workers.tests.factories import WorkerFactory, worker_token
from workers.tests.support import audit_rows, sent_events

pytestmark = pytest.mark.django_db

ACTOR = Actor.system("simpletuner server")
NAME = "local@testhost"


def _active_tokens(worker):
    return list(Token.objects.filter(worker=worker, revoked_at__isnull=True))


def test_first_provisioning_creates_a_local_worker_with_one_token(commit):
    with commit():
        worker, plaintext = worker_provision_local(name=f" {NAME} ", actor=ACTOR)

    worker.refresh_from_db()
    assert (worker.name, worker.worker_type, worker.labels, worker.status) == (
        NAME,
        WorkerType.LOCAL,
        {},
        WorkerStatus.CONNECTING,
    )
    assert plaintext.startswith("wt_")
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=plaintext).worker_id == worker.pk
    assert len(_active_tokens(worker)) == 1
    [row] = audit_rows(actions.LOCAL_WORKER_PROVISIONED)
    assert (row.target_type, row.target_id, row.actor_name) == ("worker", worker.pk, "simpletuner server")
    assert row.details == {"name": NAME, "created": True, "revoked_tokens": 0, "token_prefix": plaintext[:10]}
    assert audit_rows() == [row]
    assert sent_events() == []


def test_a_valid_token_is_reused_and_nothing_is_written(commit, control_messages):
    worker, plaintext = worker_provision_local(name=NAME, actor=ACTOR)
    tokens_before, audit_before = Token.objects.count(), len(audit_rows())

    with commit() as callbacks:
        again, reused = worker_provision_local(name=NAME, actor=ACTOR, plaintext=plaintext + "\n")

    assert (again.pk, reused) == (worker.pk, plaintext)
    assert Token.objects.count() == tokens_before
    assert len(audit_rows()) == audit_before
    assert callbacks == [] and control_messages == []


@pytest.mark.parametrize("stored", ["revoked", "unknown", "none", "other worker's"])
def test_an_unusable_token_is_replaced_and_the_old_ones_revoked(commit, control_messages, stored):
    worker, first = worker_provision_local(name=NAME, actor=ACTOR)
    old_ids = [t.pk for t in _active_tokens(worker)]
    if stored == "revoked":
        Token.objects.filter(worker=worker).update(revoked_at=timezone.now())
        plaintext = first
    else:
        plaintext = {"unknown": "wt_not-a-real-token", "none": None}.get(stored) or worker_token(WorkerFactory())

    with commit():
        again, issued = worker_provision_local(name=NAME, actor=ACTOR, plaintext=plaintext)

    assert again.pk == worker.pk
    assert issued not in (first, plaintext)
    assert [t.prefix for t in _active_tokens(worker)] == [issued[:10]]
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=first) is None
    assert Worker.objects.filter(worker_type=WorkerType.LOCAL).count() == 1
    row = audit_rows(actions.LOCAL_WORKER_PROVISIONED)[-1]
    revoked_now = 0 if stored == "revoked" else len(old_ids)
    assert row.details == {"name": NAME, "created": False, "revoked_tokens": revoked_now, "token_prefix": issued[:10]}
    if revoked_now:
        [(channel, kind, data)] = control_messages
        assert (channel, kind) == (publish.CONTROL_PREFIX + publish.worker_channel(worker.pk), publish.REVOKE)
        assert data["tokens"] == [publish.stream_principal_id(pk) for pk in old_ids]
    else:
        assert control_messages == []


def test_a_rotated_token_is_replaced_by_the_next_provisioning():
    worker, first = worker_provision_local(name=NAME, actor=ACTOR)
    rotated = worker_rotate_token(worker_id=worker.pk, actor=ACTOR)

    _, issued = worker_provision_local(name=NAME, actor=ACTOR, plaintext=first)

    assert issued not in (first, rotated)
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=rotated) is None
    assert token_authenticate(kind=TokenKind.WORKER, plaintext=issued).worker_id == worker.pk


@pytest.mark.parametrize("worker_type", [WorkerType.PERSISTENT, WorkerType.EPHEMERAL])
def test_a_name_held_by_a_remote_worker_is_refused(worker_type):
    remote = WorkerFactory(name=NAME, worker_type=worker_type)
    remote_token = worker_token(remote)

    with pytest.raises(Conflict) as refused:
        worker_provision_local(name=NAME, actor=ACTOR, plaintext=remote_token)

    assert refused.value.code == "name_taken"
    assert NAME in refused.value.detail and worker_type in refused.value.detail
    remote.refresh_from_db()
    assert remote.worker_type == worker_type
    assert [t.prefix for t in _active_tokens(remote)] == [remote_token[:10]]
    assert audit_rows() == []


def test_a_blank_name_is_refused():
    with pytest.raises(InvalidInput) as refused:
        worker_provision_local(name="  ", actor=ACTOR)

    assert refused.value.code == "invalid_name"
    assert Worker.objects.count() == 0
