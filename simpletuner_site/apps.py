"""The project's admin site in place of Django's default one (see ``simpletuner_site.admin_site``)."""

from django.contrib.admin.apps import AdminConfig


class OrchestratorAdminConfig(AdminConfig):
    default_site = "simpletuner_site.admin_site.OrchestratorAdminSite"
