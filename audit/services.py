"""Writing audit rows. Call inside the transaction of the change being recorded."""

from dataclasses import dataclass

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
    """Save unsaved audit rows in one query and announce their targets on the change feed at commit; return them."""
    if not events:
        return []
    saved = AuditEvent.objects.bulk_create(events)
    announce_changes_on_commit((event.target_type, event.target_id) for event in saved)
    return saved


def audit_events(*, actor, action, target_type, rows, success=True):
    """Return unsaved audit rows by ``actor``, one per ``(target_id, details)`` in ``rows``.

    For set-based writers (sweeps): gather every row, then ``audit_write(...)`` them in the transaction
    of the change they record.
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
