"""Writing audit rows. Call inside the transaction of the change being recorded.

Rows are written unsealed: no audited transaction waits for another's or locks anything they share. The
sealer (``audit.sweeps``) gives them their place in the chain and its HMAC once they have committed.
"""

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from django.db import connection, transaction
from django.db.transaction import TransactionManagementError

from common import outbox
from common.remote import client_ip
from common.scoped import bound

from .events import announce_changes_on_commit
from .models import ActorType, AuditEvent
from .sweeps import seal_after_commit


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
    """Save unsaved audit rows in one query, unsealed, and announce their targets at commit; return them.

    Inside an ``audit_batch()`` (``audited_atomic()``) they are held and saved with the batch's other
    rows when it ends, still in the transaction of the change they record; rows written in a savepoint
    that rolls back are dropped. Outside a transaction they are saved in their own short one. Once
    committed, the sealer chains them (``audit.sweeps``).
    """
    if not events:
        return []
    batch = _batch.get()
    if batch is not None:
        batch.hold(events)
        return events
    return _save(events)


@dataclass
class _Batch:
    depth: int  # the number of atomic blocks open when it began
    held: list = field(default_factory=list)  # (savepoint marker or None, rows)

    def hold(self, events):
        marker = None
        if _atomic_depth() > self.depth:
            # Written in a savepoint: Django drops this (no-op) commit callback if the savepoint rolls back.
            marker = _SavepointMarker()
            transaction.on_commit(marker)
        self.held.append((marker, events))

    def events(self):
        """Return the held rows, less those written in a savepoint that has rolled back since."""
        alive = {id(func) for func in outbox.pending_on_commit()}
        return [e for marker, rows in self.held if marker is None or id(marker) in alive for e in rows]


class _SavepointMarker:
    def __call__(self):
        pass


_batch = ContextVar("audit_batch", default=None)


def _atomic_depth():
    return len(connection.atomic_blocks) if connection.in_atomic_block else 0


@contextmanager
def audit_batch():
    """Hold the audit rows written in the block (``audit_write``) and save them in one INSERT at its end.

    Open it inside ``transaction.atomic()`` and close it before that ends (``audited_atomic()`` does
    both): the rows still commit or roll back with the change they record. A block left by an
    exception, or whose transaction is marked for rollback, saves nothing. Rows written in a nested
    atomic block (a savepoint) are held too, and dropped if that savepoint rolls back; a batch opened
    inside a batch joins it. Just before the rows are saved, the transaction's outbox is staged
    (``outbox.stage_pending``): the worker events it announced are stored in it. Raise
    TransactionManagementError outside a transaction.
    """
    depth = _atomic_depth()
    if not depth:
        raise TransactionManagementError("audit_batch() needs a transaction: open it inside transaction.atomic()")
    if _batch.get() is not None:
        yield
        return
    with bound(_batch, _Batch(depth)) as batch:
        yield
    if not transaction.get_rollback():
        outbox.stage_pending()  # what the transaction announces is written in it too
        _save(batch.events())


@contextmanager
def audited_atomic():
    """``transaction.atomic()`` whose audit rows are saved in one INSERT at its end (see ``audit_batch``).

    Every service transaction that writes audit rows uses it: one statement for all its rows, however
    many services it calls.
    """
    with transaction.atomic(), audit_batch():
        yield


def _save(events):
    """INSERT unsealed ``events`` in one statement (``bulk_create``) and give each its id; once the transaction
    commits, wake the sealer (``audit.sweeps``) and announce their targets. Return them."""
    if not events:
        return []
    AuditEvent.objects.bulk_create(events)
    seal_after_commit()
    announce_changes_on_commit((event.target_type, event.target_id) for event in events)
    return events


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
