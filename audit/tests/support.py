"""The audit writer's statements, for the suites that count what a service sends to the database."""

import math

from django.db import connection

from audit.models import AuditEvent


def audit_insert_statements(rows):
    """Return how many INSERTs saving ``rows`` audit rows together takes (``bulk_create``): one on PostgreSQL
    (UNNEST of arrays); on SQLite one per Django batch of 999 parameters (83 rows)."""
    fields = [f for f in AuditEvent._meta.concrete_fields if not f.primary_key]
    return math.ceil(rows / connection.ops.bulk_batch_size(fields, [None] * rows))
