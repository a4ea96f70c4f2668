"""The site's own app (its management commands) and the project's admin site in place of Django's default one."""

from django.apps import AppConfig
from django.contrib.admin.apps import AdminConfig


class SiteConfig(AppConfig):
    name = "simpletuner_site"
    verbose_name = "Site"


class OrchestratorAdminConfig(AdminConfig):
    default_site = "simpletuner_site.admin_site.OrchestratorAdminSite"
