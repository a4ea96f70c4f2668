"""Audit rows are append-only, and audit_record writes who, what, where."""

import pytest

from audit.models import AuditEvent
from audit.services import Actor, audit_record
from audit.tests.factories import AuditEventFactory
from workers.tests.factories import UserFactory, WorkerFactory

pytestmark = pytest.mark.django_db


def test_audit_record_writes_the_actor_target_and_details():
    user = UserFactory(username="alice")

    row = audit_record(
        actor=Actor.for_user(user, "203.0.113.5"),
        action="worker.created",
        target_type="worker",
        target_id="w_1",
        details={"name": "gpu-worker-1"},
    )

    stored = AuditEvent.objects.get(pk=row.pk)
    assert (stored.actor_type, stored.actor_id, stored.actor_name, stored.client_ip) == (
        "user",
        str(user.pk),
        "alice",
        "203.0.113.5",
    )
    assert (stored.action, stored.target_type, stored.target_id, stored.details, stored.success) == (
        "worker.created",
        "worker",
        "w_1",
        {"name": "gpu-worker-1"},
        True,
    )


def test_worker_and_system_actors():
    worker = WorkerFactory(name="gpu-worker-9")

    assert Actor.for_worker(worker, "10.0.0.1") == Actor("worker", worker.pk, "gpu-worker-9", "10.0.0.1")
    assert Actor.system("sweeper") == Actor("system", "", "sweeper", None)
    assert Actor.system().user_id is None
    assert Actor.for_worker(worker).user_id is None


def test_rows_cannot_be_changed_or_deleted():
    event = AuditEventFactory(action="worker.created")

    event.action = "worker.forged"
    with pytest.raises(TypeError):
        event.save()
    with pytest.raises(TypeError):
        event.delete()
    with pytest.raises(TypeError):
        AuditEvent.objects.filter(pk=event.pk).update(action="worker.forged")
    with pytest.raises(TypeError):
        AuditEvent.objects.all().delete()

    assert AuditEvent.objects.get(pk=event.pk).action == "worker.created"
