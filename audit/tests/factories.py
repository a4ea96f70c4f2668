"""factory_boy factory for audit rows (for exercising the audit API's filters)."""

import factory
from factory.django import DjangoModelFactory

from audit.models import ActorType, AuditEvent


class AuditEventFactory(DjangoModelFactory):
    class Meta:
        model = AuditEvent

    actor_type = ActorType.USER
    actor_id = "1"
    actor_name = "operator"
    action = "worker.created"
    target_type = "worker"
    target_id = factory.Sequence(lambda n: f"w_{n:012x}")
    details = factory.LazyFunction(dict)
    client_ip = "127.0.0.1"
    success = True

    @classmethod
    def _create(cls, model_class, *args, **kwargs):
        """Write the row as the services do (chained), back-dated when ``created_at`` is given."""
        from audit.services import audit_write

        (event,) = audit_write([model_class(*args, **kwargs)])
        return event
