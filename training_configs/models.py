"""Stored training configs: named, versioned, immutable once a job has used a version."""

from django.conf import settings
from django.db import models

NAME_MAX_CHARS = 200
VERSION_SEPARATOR = "@"  # config_name@version at submit
# A stored config's name: printable ASCII without "@" (the version separator) or "/" (it is a URL path
# segment), no leading or trailing space. The OpenAPI schema declares the same pattern.
NAME_PATTERN = r"^[!-.0-?A-~]([ -.0-?A-~]*[!-.0-?A-~])?$"


class TrainingConfig(models.Model):
    """One version of a named config. A version a job used never changes: editing it makes the next version."""

    name = models.CharField(max_length=NAME_MAX_CHARS, db_index=True)
    version = models.PositiveIntegerField()
    config = models.JSONField(default=dict, help_text="The trainer's config (a JSON object).")
    dataloader = models.JSONField(null=True, blank=True, help_text="The dataloader config (a JSON object or list), if any.")
    description = models.TextField(blank=True, default="")
    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    used_at = models.DateTimeField(null=True, blank=True, help_text="When a job first used this version (then it is immutable).")

    class Meta:
        ordering = ["name", "-version"]
        constraints = [models.UniqueConstraint(fields=["name", "version"], name="config_version_unique")]
        permissions = [("view_config_secrets", "Can view the secret values in configs and jobs' configs")]

    def __str__(self):
        return f"{self.name}{VERSION_SEPARATOR}{self.version}"

    @property
    def immutable(self):
        return self.used_at is not None
