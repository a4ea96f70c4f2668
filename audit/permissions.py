"""The permission to read the audit trail (checked by ``common.permissions``)."""

VIEW_AUDIT = "audit.view_auditevent"
