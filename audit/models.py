"""The append-only audit trail: who did what to which object, when, from where."""

from django.db import models
from django.utils import timezone


class ActorType(models.TextChoices):
    USER = "user", "User"
    WORKER = "worker", "Worker"
    SYSTEM = "system", "System"


class AuditEventQuerySet(models.QuerySet):
    def update(self, **kwargs):
        raise TypeError("Audit events are append-only")

    def delete(self):
        raise TypeError("Audit events are append-only")


class AuditEvent(models.Model):
    """One audited action, chained to the one before it (``seq``, ``chain_hash``: see ``audit.chain``)."""

    # Set when the row is built, not at INSERT: it is part of what the chain hashes.
    created_at = models.DateTimeField(default=timezone.now, db_index=True)
    actor_type = models.CharField(max_length=8, choices=ActorType.choices)
    actor_id = models.CharField(max_length=64, blank=True, default="")
    actor_name = models.CharField(max_length=150, blank=True, default="")
    action = models.CharField(max_length=64, db_index=True)
    target_type = models.CharField(max_length=32, blank=True, default="")
    target_id = models.CharField(max_length=64, blank=True, default="", db_index=True)
    details = models.JSONField(default=dict, blank=True)
    client_ip = models.GenericIPAddressField(null=True, blank=True)
    success = models.BooleanField(default=True)
    seq = models.BigIntegerField(unique=True)  # the row's place in the chain: 1, 2, 3, ... without gaps
    chain_hash = models.CharField(max_length=64)

    objects = AuditEventQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["target_type", "target_id", "created_at"], name="audit_target")]

    def __str__(self):
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.action} {self.target_type}:{self.target_id}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise TypeError("Audit events are append-only")
        if self.seq is None:
            raise TypeError("Audit events are written by audit.services.audit_write, which chains them")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise TypeError("Audit events are append-only")


HEAD_ID = 1


class AuditChainHead(models.Model):
    """The chain's last link (one row): locked by every append, so two writers never fork the chain."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=HEAD_ID)
    seq = models.BigIntegerField(default=0)
    chain_hash = models.CharField(max_length=64)

    def __str__(self):
        return f"audit chain head: seq {self.seq}"
