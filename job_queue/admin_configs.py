"""The job admin page's link to the stored config version a job runs."""

from django.urls import reverse
from django.utils.html import format_html


def stored_config_html(job):
    """Return a link to the stored config version ``job`` runs, or "config not stored"."""
    if job.training_config_id is None:
        return format_html('<span class="st-muted">{}</span>', "config not stored")
    config = job.training_config
    return format_html('<a href="{}">{}</a>', reverse("admin:configs_trainingconfig_change", args=[config.pk]), str(config))
