"""The append-only audit trail: who did what to which object, when, from where."""

from django.db import models
from django.db.models import Q
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
    """One audited action: written unsealed in the transaction of the change it records, then sealed, chained to
    the row sealed before it (``seq``, ``chain_hash``: see ``audit.chain``), by the sealer (``audit.sweeps``)."""

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
    # The row's place in the chain (1, 2, 3, ... without gaps) and its link: None and "" until the sealer seals it.
    seq = models.BigIntegerField(unique=True, null=True, blank=True)
    chain_hash = models.CharField(max_length=64, blank=True, default="")

    objects = AuditEventQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [
            models.Index(fields=["target_type", "target_id", "created_at"], name="audit_target"),
            # The rows the sealer has still to seal, in id order: a handful, however long the trail.
            models.Index(fields=["id"], condition=Q(seq__isnull=True), name="audit_unsealed"),
        ]

    def __str__(self):
        return f"{self.created_at:%Y-%m-%d %H:%M:%S} {self.action} {self.target_type}:{self.target_id}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise TypeError("Audit events are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise TypeError("Audit events are append-only")


HEAD_ID = 1


class AuditChainHead(models.Model):
    """The chain's last sealed link (one row): locked by the sealer alone, so two sealers never fork the chain."""

    id = models.PositiveSmallIntegerField(primary_key=True, default=HEAD_ID)
    seq = models.BigIntegerField(default=0)
    chain_hash = models.CharField(max_length=64)

    def __str__(self):
        return f"audit chain head: seq {self.seq}"
