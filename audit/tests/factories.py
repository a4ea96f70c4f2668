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
        created_at = kwargs.pop("created_at", None)
        event = super()._create(model_class, *args, **kwargs)
        if created_at is not None:
            # Audit rows are append-only through the ORM; a test back-dates one with raw SQL.
            from django.db import connection

            table = connection.ops.quote_name(model_class._meta.db_table)
            with connection.cursor() as cursor:
                cursor.execute(
                    f"UPDATE {table} SET created_at = %s WHERE id = %s",
                    [connection.ops.adapt_datetimefield_value(created_at), event.pk],
                )
            event.created_at = created_at
        return event
