"""What the workers app announces through ``common.outbox``: events for a worker's stream, and revoked streams.

``realtime`` subscribes to both topics and turns them into SSE (``realtime.publish``).
"""

from common import outbox
from worker_agent import protocol

WORKER_EVENT = "worker.event"  # payload: worker_id, event (a protocol event dict with its "type")
STREAMS_REVOKED = "worker.streams_revoked"  # payload: worker_id, token_ids, reason, code
# Staged by ``webhooks`` in the changing transaction (its deliveries of worker.offline).
STATUS_CHANGED = "worker.status_changed"  # payload: changes, [(worker_id, from_status, to_status)]; at (when)


def publish_on_commit(worker_id, event_type, **payload):
    """Send ``event_type`` with ``payload`` to ``worker_id``'s stream once the current transaction commits."""
    outbox.emit_on_commit(WORKER_EVENT, worker_id=worker_id, event={"type": event_type, **payload})


def revoke_streams_on_commit(worker_id, token_ids, reason, *, code=protocol.TOKEN_REVOKED):
    """Close every open stream of ``worker_id`` opened with one of ``token_ids``, on commit.

    The agent gets a ``shutdown`` event with ``reason`` and the machine-readable ``code``.
    """
    outbox.emit_on_commit(STREAMS_REVOKED, worker_id=worker_id, token_ids=list(token_ids), reason=reason, code=code)
