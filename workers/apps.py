from django.apps import AppConfig


class WorkersConfig(AppConfig):
    name = "workers"
    verbose_name = "Workers"

    def ready(self):
        from .api import schema  # noqa: F401  registers the OpenAPI authentication extensions
