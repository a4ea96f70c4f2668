"""Writing audit rows. Call inside the transaction of the change being recorded."""

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from django.db import transaction
from django.db.transaction import TransactionManagementError

from common.remote import client_ip

from .events import announce_changes_on_commit
from .models import ActorType, AuditEvent


@dataclass(frozen=True)
class Actor:
    """Who performed an action: a user, a worker, or the system itself (sweeps, commands)."""

    type: str
    id: str = ""
    name: str = ""
    ip: str | None = None

    @classmethod
    def for_user(cls, user, ip=None):
        return cls(ActorType.USER, str(user.pk), user.get_username(), ip)

    @classmethod
    def for_worker(cls, worker, ip=None):
        return cls(ActorType.WORKER, worker.pk, worker.name, ip)

    @classmethod
    def for_request(cls, request):
        """The signed-in operator making ``request`` (API or admin), with their address."""
        return cls.for_user(request.user, client_ip(request))

    @classmethod
    def system(cls, name="system"):
        return cls(ActorType.SYSTEM, "", name, None)

    @property
    def user_id(self):
        return int(self.id) if self.type == ActorType.USER and self.id else None


def audit_record(*, actor, action, target_type="", target_id="", details=None, success=True):
    """Append one audit row for ``action`` by ``actor`` on ``target_type:target_id``; return it."""
    (event,) = audit_write(
        audit_events(actor=actor, action=action, target_type=target_type, rows=[(target_id, details)], success=success)
    )
    return event


def audit_write(events):
    """Save unsaved audit rows in one query and announce their targets on the change feed at commit; return them.

    Inside an ``audit_batch()`` (at its level of transaction) they are saved with the batch's other rows
    when the batch ends, still in the transaction of the change they record.
    """
    if not events:
        return []
    batch = _batch.get()
    if batch is not None and batch.depth == _atomic_depth():
        batch.events += events
        return events
    return _save(events)


@dataclass
class _Batch:
    depth: int  # the number of atomic blocks open when it began
    events: list = field(default_factory=list)


_batch = ContextVar("audit_batch", default=None)


def _atomic_depth():
    connection = transaction.get_connection()
    return len(connection.atomic_blocks) if connection.in_atomic_block else 0


@contextmanager
def audit_batch():
    """Gather the audit rows written in the block (``audit_write``) and save them in one INSERT at its end.

    For a caller that runs several transitions in one transaction (a sweep): each appends its rows,
    and the block writes them all at once, before its transaction commits, so they still commit or
    roll back with the change they record. Open it inside ``transaction.atomic()`` and close it before
    that ends: ``with transaction.atomic(), audit_batch():``. A block left by an exception saves
    nothing (its transaction is rolling back). Rows written inside a nested atomic block (a savepoint,
    which may roll back alone) are saved at once, as without a batch; a batch opened inside a batch at
    the same level joins it. Raise TransactionManagementError outside a transaction.
    """
    depth = _atomic_depth()
    if not depth:
        raise TransactionManagementError("audit_batch() needs a transaction: open it inside transaction.atomic()")
    outer = _batch.get()
    if outer is not None and outer.depth == depth:
        yield
        return
    batch = _Batch(depth)
    token = _batch.set(batch)
    try:
        yield
    finally:
        _batch.reset(token)
    _save(batch.events)


def _save(events):
    if not events:
        return []
    saved = AuditEvent.objects.bulk_create(events)
    announce_changes_on_commit((event.target_type, event.target_id) for event in saved)
    return saved


def audit_events(*, actor, action, target_type, rows, success=True):
    """Return unsaved audit rows by ``actor``, one per ``(target_id, details)`` in ``rows``.

    For set-based writers: gather every row, then ``audit_write(...)`` them in the transaction of the
    change they record.
    """
    return [
        AuditEvent(
            actor_type=actor.type,
            actor_id=actor.id,
            actor_name=actor.name,
            action=action,
            target_type=target_type,
            target_id=str(target_id or ""),
            details=details or {},
            client_ip=actor.ip,
            success=success,
        )
        for target_id, details in rows
    ]
