"""Teams (a name and member users) and the limits that apply to jobs: global, per team and per user."""

from django.conf import settings
from django.db import models

TEAM_NAME_MAX_CHARS = 64
TEAM_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# The largest figures a limit takes: far beyond any fleet, small enough for every column and for JSON.
MAX_RUNNING_JOBS_MAX = 1_000_000
MAX_GPUS_MAX = 1_000_000
GPU_HOURS_MAX = 1e9
LIMIT_FIELDS = ("max_running_jobs", "max_gpus", "gpu_hours_per_30_days")


class Team(models.Model):
    name = models.CharField(max_length=TEAM_NAME_MAX_CHARS, unique=True)
    members = models.ManyToManyField(settings.AUTH_USER_MODEL, blank=True, related_name="teams")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]
        permissions = [
            ("set_limits", "Can set job limits and GPU-hour quotas (global, team, user)"),
            ("view_usage", "Can read one's own GPU usage"),
            ("view_all_usage", "Can read everyone's GPU usage"),
            ("prioritize_jobs", "Can submit jobs with a priority above 0, up to the operators' ceiling"),
            ("prioritize_jobs_any", "Can submit jobs with any priority"),
        ]

    def __str__(self):
        return self.name


class LimitScope(models.TextChoices):
    GLOBAL = "global", "Global"
    TEAM = "team", "Team"
    USER = "user", "User"


class Limits(models.Model):
    """The limits of one scope: the whole fleet (one row), a team or a user. A null figure is no limit."""

    scope = models.CharField(max_length=8, choices=LimitScope.choices)
    team = models.OneToOneField(Team, null=True, blank=True, on_delete=models.CASCADE, related_name="limits")
    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.CASCADE, related_name="job_limits"
    )
    max_running_jobs = models.PositiveIntegerField(null=True, blank=True, help_text="Jobs dispatched or running at once.")
    max_gpus = models.PositiveIntegerField(null=True, blank=True, help_text="GPUs held by dispatched or running jobs.")
    gpu_hours_per_30_days = models.FloatField(null=True, blank=True, help_text="GPU-hours over a rolling 30 days.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name_plural = "limits"
        constraints = [
            models.UniqueConstraint(fields=["scope"], condition=models.Q(scope="global"), name="limits_one_global"),
            models.CheckConstraint(
                condition=models.Q(scope="global", team__isnull=True, user__isnull=True)
                | models.Q(scope="team", team__isnull=False, user__isnull=True)
                | models.Q(scope="user", team__isnull=True, user__isnull=False),
                name="limits_scope_matches",
            ),
        ]

    def __str__(self):
        if self.scope == LimitScope.TEAM:
            return f"team {self.team.name}"
        if self.scope == LimitScope.USER:
            return f"user {self.user.get_username()}"
        return "global"

    def as_dict(self):
        return {name: getattr(self, name) for name in LIMIT_FIELDS}


NO_LIMITS = dict.fromkeys(LIMIT_FIELDS)
